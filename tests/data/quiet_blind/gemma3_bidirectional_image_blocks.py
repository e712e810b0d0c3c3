"""Gemma 3 multimodal: causal text with bidirectional attention inside each image's token block.

Follows huggingface/transformers src/transformers/models/gemma3/modeling_gemma3.py
(token_type_ids_mask_function: image_group_ids from token_type_ids == 1 runs; the mask is
causal OR (query and key in the same image group)), and Gemma3Config's layer_types with
"sliding_attention" layers (sliding_window) interleaved with "full_attention" layers.
Mask meant: text tokens are causal (sliding layers: also within sliding_window); the tokens of one image
see each other in both directions, including later tokens of the same image; two different images do not
see each other bidirectionally. Boolean masks into F.scaled_dot_product_attention.
"""
import torch
import torch.nn.functional as F
from torch import nn


class Gemma3TextConfig:
    def __init__(self, hidden_size=32, num_attention_heads=4, sliding_window=10,
                 layer_types=("sliding_attention", "full_attention")):
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.sliding_window = sliding_window
        self.layer_types = list(layer_types)


def image_group_ids_from(token_type_ids):
    """-1 for text; k for the k-th contiguous run of image tokens (token_type_ids == 1)."""
    is_image = token_type_ids == 1
    new_image_start = is_image & ~F.pad(is_image, (1, 0), value=False)[:, :-1]
    group_ids = torch.cumsum(new_image_start.int(), dim=1) - 1
    return torch.where(is_image, group_ids, -1)


def build_mask(token_type_ids, attention_mask, sliding_window=None):
    seq = token_type_ids.shape[1]
    q_idx = torch.arange(seq)[:, None]
    kv_idx = torch.arange(seq)[None, :]
    causal = kv_idx <= q_idx
    if sliding_window is not None:
        causal = causal & (q_idx - kv_idx < sliding_window)
    group = image_group_ids_from(token_type_ids)
    same_image = (group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0)
    mask = causal[None] | same_image
    mask = mask & attention_mask[:, None, :].bool()
    return mask[:, None]                 # [bs, 1, q, kv]


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.config.num_attention_heads, self.config.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


def main():
    torch.manual_seed(0)
    config = Gemma3TextConfig()
    # <bos> text <start_of_image> [img x6] <end_of_image> text <start_of_image> [img x6] <end_of_image> text
    token_type_ids = torch.tensor([[0, 0, 0, 0] + [1] * 6 + [0, 0, 0] + [1] * 6 + [0, 0, 0]])
    attention_mask = torch.ones_like(token_type_ids)
    hidden_states = torch.randn(1, token_type_ids.shape[1], config.hidden_size)

    mask_mapping = {
        "full_attention": build_mask(token_type_ids, attention_mask),
        "sliding_attention": build_mask(token_type_ids, attention_mask, config.sliding_window),
    }
    layers = [Gemma3Attention(config, i) for i in range(len(config.layer_types))]
    with torch.no_grad():
        for layer in layers:
            hidden_states = hidden_states + layer(hidden_states, mask_mapping[config.layer_types[layer.layer_idx]])
    print("hidden", tuple(hidden_states.shape))


if __name__ == "__main__":
    main()
