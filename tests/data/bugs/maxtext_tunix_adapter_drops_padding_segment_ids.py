"""MaxText TunixMaxTextAdapter: the RL trainer's padded batch reaches MaxText with no segment ids, causal only.

Citation: AI-Hypercomputer/maxtext PR #4016 ("Fix: synthesize segment_ids in TunixMaxTextAdapter to mask pad
attention", merged). Read: the PR description, and the pre-fix
src/maxtext/integration/tunix/tunix_adapter.py (stored copy). The fixed lines follow the PR description (its diff
was not read): an optional `pad_id` constructor argument, and segment ids `(input_tokens != pad_id)` synthesized
when Tunix passes `decoder_segment_ids=None`. MaxText's attention (JAX) is ported to torch: causal mask AND'ed
with `q_segment == kv_segment` when segment ids are given, as MaxText's attention_op does.

Bug: Tunix trainers call `adapter(input_tokens, positions, cache, attention_mask, decoder_segment_ids=None)`.
The adapter drops `attention_mask` ([B, L, L], which marks the padding) and forwards
`decoder_segment_ids=None` to `Transformer`, which then applies only the causal mask: in the left-padded
(prompt) / right-padded (completion) batch, real tokens attend to the pad tokens before them, corrupting the
trainer's log-probs.

Fix: `TunixMaxTextAdapter(..., pad_id=tokenizer.pad_token_id)`; when `decoder_segment_ids is None`,
`decoder_segment_ids = (input_tokens != pad_id).astype(int32)`.

This program runs one policy log-prob forward on a batch of two rollouts (prompt left-padded to 4, completion
right-padded to 4, pad_id 0) as GRPO's trainer does.
"""
import sys
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Transformer(nn.Module):
    """Condensed MaxText decoder: embed, N layers of causal (segment-aware) attention + MLP, logits."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.emb_dim)
        self.pos = nn.Embedding(config.max_target_length, config.emb_dim)
        self.qkv = nn.ModuleList(nn.Linear(config.emb_dim, 3 * config.emb_dim) for _ in range(config.num_decoder_layers))
        self.mlp = nn.ModuleList(nn.Linear(config.emb_dim, config.emb_dim) for _ in range(config.num_decoder_layers))
        self.logits = nn.Linear(config.emb_dim, config.vocab_size)

    def attention_mask(self, length, decoder_segment_ids):
        mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
        if decoder_segment_ids is not None:
            same_segment = decoder_segment_ids[:, :, None] == decoder_segment_ids[:, None, :]
            mask = mask & same_segment[:, None]
        return mask

    def forward(self, decoder_input_tokens, decoder_positions, decoder_segment_ids=None):
        B, L = decoder_input_tokens.shape
        H = self.config.num_query_heads
        x = self.embed(decoder_input_tokens) + self.pos(decoder_positions)
        mask = self.attention_mask(L, decoder_segment_ids)
        for qkv, mlp in zip(self.qkv, self.mlp):
            q, k, v = qkv(x).view(B, L, 3, H, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + a.transpose(1, 2).reshape(B, L, -1)
            x = x + mlp(F.silu(x))
        return self.logits(x)


class TunixMaxTextAdapter(nn.Module):
    """Adapter exposing Tunix Trainer call signature over a Transformer model."""

    def __init__(self, base_model: Transformer, pad_id: Optional[int] = None):
        super().__init__()
        self.base = base_model
        self.pad_id = pad_id

    def forward(self, input_tokens, positions, cache: Optional[Any], attention_mask, decoder_segment_ids=None,
                output_hidden_states: bool = False):
        if FIXED and decoder_segment_ids is None and self.pad_id is not None:
            decoder_segment_ids = (input_tokens != self.pad_id).to(torch.int32)
        logits = self.base(
            decoder_input_tokens=input_tokens,
            decoder_positions=positions,
            decoder_segment_ids=decoder_segment_ids,
        )
        return logits, None


def make_causal_attn_mask(input_mask):
    """tunix.generate.utils: [B, L] validity -> [B, L, L] causal & padding mask."""
    L = input_mask.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return input_mask[:, None, :] & causal[None]


if __name__ == "__main__":
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=64, emb_dim=32, num_query_heads=2, num_decoder_layers=2, max_target_length=16)
    pad_id = 0  # tokenizer.pad_token_id, plumbed by model_creation_utils in the fix
    model = TunixMaxTextAdapter(Transformer(config), pad_id=pad_id).eval()

    prompt_tokens = torch.tensor([[0, 0, 11, 12], [21, 22, 23, 24]])        # left-padded prompts
    completion_tokens = torch.tensor([[31, 32, 33, 0], [41, 42, 0, 0]])     # right-padded completions
    input_tokens = torch.cat([prompt_tokens, completion_tokens], dim=1)
    input_mask = input_tokens != pad_id
    positions = (input_mask.long().cumsum(-1) - 1).clamp(min=0)
    attention_mask = make_causal_attn_mask(input_mask)
    with torch.no_grad():
        logits, _ = model(input_tokens, positions, None, attention_mask)
    logps = torch.log_softmax(logits[:, 3:-1], -1).gather(-1, completion_tokens[..., None]).squeeze(-1)
    per_token_logps = (logps * (completion_tokens != pad_id)).sum(-1)
    print("fixed" if FIXED else "buggy", tuple(logits.shape), [f"{v:.4f}" for v in per_token_logps.tolist()])
