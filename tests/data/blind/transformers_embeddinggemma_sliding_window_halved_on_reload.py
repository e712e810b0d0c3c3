"""transformers Gemma3 (EmbeddingGemma): the bidirectional sliding window halves on every config save/reload.

Citation: huggingface/transformers PR #47940 ("Fix Gemma `sliding_window` being halved on every config
save/reload"; description read, it quotes the buggy `__post_init__` line and the 512 -> 257 -> 129 chain).
The bidirectional overlay (`abs(q_idx - kv_idx) < sliding_window`) is the one `masking_utils` uses for
`use_bidirectional_attention` since PR #40700. The fixed config below is written from the PR description
(the declared window is kept in `sliding_window`; the kernels' exclusive half-window is derived from it
without being written back), not copied from the merged diff.

Bug: `Gemma3TextConfig.__post_init__` converts the declared window into the exclusive half-window and
stores it back in `sliding_window`: `self.sliding_window = (self.sliding_window // 2) + 1`.
`save_pretrained` persists the converted value and the next load converts it again, so a fine-tuned
EmbeddingGemma that is saved and served again attends a window that shrinks with every round trip.

Fix: keep the declared value in `sliding_window` (what is serialized) and compute the half-window used
by the mask from it.

Reproduction: config created with `sliding_window=8, use_bidirectional_attention=True`, serialized
to a JSON string and reloaded (no file written), then a sliding layer encodes 12 tokens with the
bidirectional window mask through `F.scaled_dot_product_attention`.
"""
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Gemma3TextConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    head_dim: int = 8
    sliding_window: int = 512
    use_bidirectional_attention: bool = False

    def __post_init__(self):
        if self.use_bidirectional_attention and not FIXED:
            self.sliding_window = (self.sliding_window // 2) + 1  # due to fa we set exclusive bounds

    @property
    def attention_sliding_window(self) -> int:
        """Window bound the mask / kernels use."""
        if FIXED and self.use_bidirectional_attention:
            return (self.sliding_window // 2) + 1  # exclusive half-window, not written back
        return self.sliding_window

    def to_json_string(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json_string(cls, text: str) -> "Gemma3TextConfig":
        return cls(**json.loads(text))


def _bidirectional_window_overlay(sliding_window: int):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return abs(q_idx - kv_idx) < sliding_window
    return inner_mask


def create_bidirectional_sliding_mask(config: Gemma3TextConfig, seq_len: int) -> torch.Tensor:
    idx = torch.arange(seq_len)
    overlay = _bidirectional_window_overlay(config.attention_sliding_window)
    return overlay(0, 0, idx[:, None], idx[None, :])[None, None]


class Gemma3SlidingAttention(torch.nn.Module):
    def __init__(self, config: Gemma3TextConfig):
        super().__init__()
        self.n, self.d = config.num_attention_heads, config.head_dim
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * self.n * self.d, bias=False)

    def forward(self, hidden_states, attention_mask):
        b, t, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, t, 3, self.n, self.d).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask).transpose(1, 2).reshape(b, t, -1)


def main():
    config = Gemma3TextConfig(sliding_window=8, use_bidirectional_attention=True)
    # save_pretrained / from_pretrained round trip, kept in memory
    reloaded = Gemma3TextConfig.from_json_string(config.to_json_string())
    print("sliding_window after init", config.sliding_window, "after reload", reloaded.sliding_window)
    embed = torch.nn.Embedding(reloaded.vocab_size, reloaded.hidden_size)
    layer = Gemma3SlidingAttention(reloaded)
    input_ids = torch.randint(0, reloaded.vocab_size, (1, 12))
    with torch.no_grad():
        out = layer(embed(input_ids), create_bidirectional_sliding_mask(reloaded, 12))
    print("mean-pooled embedding norm", round(float(out.mean(1).norm()), 4))


if __name__ == "__main__":
    main()
