"""A Gemma 4 port whose composite config is a dataclass of its own (no get_text_config(): its `text_config` field
states use_bidirectional_attention="vision", the sliding window and the layer types), called with mm_token_type_ids
over a right-padded batch; the mask builder ignores the token types, so each image runs causal on the sliding layers.
--fixed: the sliding layers' mask is AND(window, OR(causal, same image)), the full layer causal."""

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class TextConfig:
    hidden_size: int = 16
    num_attention_heads: int = 2
    sliding_window: int = 3
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"])
    use_bidirectional_attention: str = "vision"


@dataclass
class Gemma4Config:
    text_config: TextConfig = field(default_factory=TextConfig)
    image_token_id: int = 9


class Layer(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, x, mask):
        b, l, d = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, l, d)


class Gemma4Model(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        text = config.text_config
        self.embed = torch.nn.Embedding(16, text.hidden_size)
        self.layers = torch.nn.ModuleList(Layer(text) for _ in text.layer_types)

    def forward(self, input_ids, attention_mask, mm_token_type_ids):
        text = self.config.text_config
        length = input_ids.shape[1]
        q = torch.arange(length)[:, None]
        k = torch.arange(length)[None, :]
        causal = (k <= q)[None] & attention_mask[:, None, :].bool()
        window = causal & (q - k < text.sliding_window)[None]
        if FIXED:
            image = mm_token_type_ids == 1
            starts = image & ~F.pad(image, (1, 0))[:, :-1]
            group = torch.where(image, starts.cumsum(-1), -1)
            same = (group[:, :, None] == group[:, None, :]) & (group[:, :, None] >= 0)
            window = window | (same & (q - k < text.sliding_window)[None])
        masks = {"sliding_attention": window[:, None], "full_attention": causal[:, None]}
        x = self.embed(input_ids)
        for kind, layer in zip(text.layer_types, self.layers):
            x = layer(x, masks[kind])
        return x


torch.manual_seed(0)
ids = torch.tensor([[2, 9, 9, 9, 9, 4, 0, 0], [2, 3, 9, 9, 9, 5, 6, 4]])
with torch.no_grad():
    out = Gemma4Model(Gemma4Config())(ids, (ids != 0).long(), (ids == 9).long())
print("out norm:", round(out.norm().item(), 4))
