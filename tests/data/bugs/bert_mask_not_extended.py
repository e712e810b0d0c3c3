"""huggingface/transformers#542 and #5295: BERT adds its attention mask to the scores, so the 0/1 attention_mask of the
tokenizer must first become (1 - mask) * -10000 (get_extended_attention_mask); code that hands the 0/1 mask to the
attention as it is masks nothing (adding 1 to the real tokens' scores changes no softmax). The fix extends it first."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
attention_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
hidden = torch.randn(2, 2, 4, 8)
extended = attention_mask[:, None, None, :].to(hidden.dtype)
if FIXED:
    extended = (1.0 - extended) * torch.finfo(hidden.dtype).min
out = F.scaled_dot_product_attention(hidden, hidden, hidden, attn_mask=extended)
