# huggingface/transformers#40700 ([Gemma Embedding] Fix SWA): with use_bidirectional_attention the sliding
# layers' mask_mod OR-ed "distance <= sliding_window // 2" onto the causal sliding window, giving (SW-1, SW//2).
import sys
import warnings
from dataclasses import dataclass, field
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
warnings.filterwarnings("ignore")


@dataclass
class Gemma3TextConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 2
    head_dim: int = 16
    sliding_window: int = 8
    use_bidirectional_attention: bool = True
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])

    def __post_init__(self):
        if FIXED and self.use_bidirectional_attention:
            self.sliding_window = (self.sliding_window // 2) + 1  # due to fa we set exclusive bounds


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window_overlay(sliding_window):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window
    return inner_mask


def and_masks(*mask_functions):
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for mask in mask_functions:
            result = result & mask(batch_idx, head_idx, q_idx, kv_idx)
        return result
    return and_mask


def or_masks(*mask_functions):
    def or_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_zeros((), dtype=torch.bool)
        for mask in mask_functions:
            result = result | mask(batch_idx, head_idx, q_idx, kv_idx)
        return result
    return or_mask


def _bidirectional_window_overlay(sliding_window):
    """Enables a bidirectional mask within the sliding window."""
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        if FIXED:
            return abs(q_idx - kv_idx) < sliding_window
        # a token attends any token within half the sliding window size
        return abs(q_idx - kv_idx) <= sliding_window // 2
    return inner_mask


def create_mask(mask_function, seq_len, or_mask_function=None):
    if or_mask_function is not None:
        mask_function = or_masks(mask_function, or_mask_function)
    return create_block_mask(mask_function, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device="cpu")


class Gemma3Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n, self.d = config.num_attention_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * self.n * self.d, bias=False)
        self.o_proj = nn.Linear(self.n * self.d, config.hidden_size, bias=False)

    def forward(self, x, block_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n, self.d).permute(2, 0, 3, 1, 4)
        out = flex_attention(q, k, v, block_mask=block_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), (q, k, v)


class Gemma3TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma3Attention(config) for _ in config.layer_types])
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids):
        seq_len = input_ids.shape[1]
        full_or, sliding_or = None, None
        if self.config.use_bidirectional_attention:
            full_or = lambda *args: torch.tensor(True, dtype=torch.bool)
            sliding_or = _bidirectional_window_overlay(self.config.sliding_window)
        causal_mask_mapping = {
            "full_attention": create_mask(causal_mask_function, seq_len, full_or),
            "sliding_attention": create_mask(
                and_masks(causal_mask_function, sliding_window_overlay(self.config.sliding_window)), seq_len, sliding_or),
        }
        h, qkvs = self.embed_tokens(input_ids), []
        for layer_type, layer in zip(self.config.layer_types, self.layers):
            out, qkv = layer(self.norm(h), causal_mask_mapping[layer_type])
            h = h + out
            qkvs.append(qkv)
        return h, qkvs


config = Gemma3TextConfig()
model = Gemma3TextModel(config).eval()
ids = torch.randint(0, config.vocab_size, (1, 24))
with torch.no_grad():
    hidden, qkvs = model(ids)
    # the reference: the sliding layer of EmbeddingGemma sees 8 // 2 = 4 tokens on each side
    q, k, v = qkvs[0]
    pos = torch.arange(ids.shape[1])
    band = (pos[:, None] - pos[None, :]).abs() <= 8 // 2
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
    got = flex_attention(q, k, v, block_mask=create_mask(
        and_masks(causal_mask_function, sliding_window_overlay(config.sliding_window)), ids.shape[1],
        _bidirectional_window_overlay(config.sliding_window)))
print("fixed" if FIXED else "buggy", "sliding layer attention max |diff| vs a +-4 band:",
      f"{(got - ref).abs().max().item():.4f}", "embedding[0,:3]:", [round(x, 4) for x in hidden[0, 0, :3].tolist()])
