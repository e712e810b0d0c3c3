"""A hand-written Gemma 4 style decoder whose image blocks are or-ed onto the wrong layers.

The config is a plain dict at the top of the program: its `text_config` states `use_bidirectional_attention="vision"`,
`layer_types` and `sliding_window`, and the outer dict the `image_token_index`. A batch of two rows, each with one image
(id 9) of 3 tokens, a softmax of the program's own. Buggy: the layer loop picks the image overlay by `i % 2 == 1`, so the
full layer gets the bidirectional images and the sliding layer stays causal; fixed (--fixed): the overlay follows
`layer_types` (sliding layers only, as Gemma 4 does).
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

hf_config = {
    "image_token_index": 9,
    "text_config": {"hidden_size": 16, "num_attention_heads": 2, "sliding_window": 4,
                    "layer_types": ["sliding_attention", "full_attention"], "use_bidirectional_attention": "vision"},
}


def image_blocks(is_image):
    """Each run of image tokens one block id, -1 elsewhere."""
    start = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, start.cumsum(-1) - 1, -1)


class Layer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) / x.shape[-1] ** 0.5
        return x + scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


class Decoder(nn.Module):
    def __init__(self, text, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, text["hidden_size"])
        self.layers = nn.ModuleList([Layer(text["hidden_size"]) for _ in text["layer_types"]])
        self.window, self.types = text["sliding_window"], text["layer_types"]

    def forward(self, input_ids, image_token):
        n = input_ids.shape[1]
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        causal = (k <= q)[None]
        blocks = image_blocks(input_ids == image_token)
        same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
        h = self.emb(input_ids)
        for i, layer in enumerate(self.layers):
            sliding = self.types[i] == "sliding_attention"
            both_ways = sliding if FIXED else i % 2 == 1
            keep = causal | same if both_ways else causal
            if sliding:
                keep = keep & ((q - k).abs() < self.window)[None]
            h = layer(h, keep)
        return h


def main():
    torch.manual_seed(0)
    model = Decoder(hf_config["text_config"]).eval()
    input_ids = torch.tensor([[1, 9, 9, 9, 4, 5, 6], [1, 2, 3, 9, 9, 9, 7]])
    with torch.no_grad():
        out = model(input_ids, hf_config["image_token_index"])
    print(f"{'fixed' if FIXED else 'buggy'} out {out.sum().item():.4f}")


if __name__ == "__main__":
    main()
