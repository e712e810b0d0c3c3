"""An LLM2Vec-style embedding model: `Qwen2BiModel` subclasses transformers' Qwen2Model and turns each attention
layer's `is_causal` off, meaning every token to see every other one, then mean-pools a right-padded batch. The
library builds the causal mask itself (masking_utils.create_causal_mask) and hands it to the layers, so the flag alone
changes nothing and the model stays causal. The fix (--fixed) hands the layers a 4-D mask of its own: the padding
only. Written for tests/test_checks_bidirname.py."""
import sys

import torch
from transformers import Qwen2Config, Qwen2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Qwen2BiModel(Qwen2Model):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            layer.self_attn.is_causal = False

    def forward(self, input_ids, attention_mask):
        if FIXED:
            keep = attention_mask[:, None, None, :].bool().expand(-1, 1, input_ids.shape[1], -1)
            attention_mask = torch.zeros(keep.shape, dtype=self.dtype).masked_fill(~keep, torch.finfo(self.dtype).min)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask)


config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, attn_implementation="sdpa")
model = Qwen2BiModel(config).eval()
ids = torch.randint(1, 64, (2, 7))
mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
with torch.no_grad():
    hidden = model(ids, mask).last_hidden_state
pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
print("embedding norms", pooled.norm(dim=-1).tolist())
