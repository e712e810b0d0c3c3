"""A hand-written Gemma 4 port whose image tokens see each other both ways though its config leaves them causal.

Written for maskcli's span-leak (a second program beside Megatron-Bridge#5333, written another way): the config is a
dict at the top of the program (model_type "gemma4", the text config's use_bidirectional_attention None, as
gemma-4-E2B ships it), the batch is left-padded, the mask additive and built by the model for an eager softmax, the
image span or-ed onto the causal mask without reading the config. Fix: the span only where the config says "vision".
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

hf_config = {
    "model_type": "gemma4",
    "image_token_id": 9,
    "text_config": {"model_type": "gemma4_text", "vocab_size": 16, "hidden_size": 16, "num_attention_heads": 2,
                    "num_hidden_layers": 1, "use_bidirectional_attention": None},
}


class TinyGemma4(nn.Module):
    def __init__(self, vocab, dim, heads, image_token, bidirectional):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads, self.image_token, self.bidirectional = heads, image_token, bidirectional

    def forward(self, input_ids, attention_mask):
        b, t = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        allowed = torch.ones(t, t).tril().bool()[None].expand(b, t, t)
        is_image = input_ids == self.image_token
        if self.bidirectional == "vision" or not FIXED:
            run = torch.cumsum(is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1], dim=1)
            block = torch.where(is_image, run, -1)
            allowed = allowed | ((block[:, :, None] == block[:, None, :]) & is_image[:, :, None])
        allowed = allowed & attention_mask.bool()[:, None, :]
        bias = torch.zeros(b, 1, t, t).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)


if __name__ == "__main__":
    torch.manual_seed(0)
    text = hf_config["text_config"]
    model = TinyGemma4(text["vocab_size"], text["hidden_size"], text["num_attention_heads"], hf_config["image_token_id"],
                       text["use_bidirectional_attention"]).eval()
    input_ids = torch.tensor([[0, 0, 2, 9, 9, 9, 3, 4], [2, 3, 9, 9, 9, 9, 9, 4]])
    attention_mask = (input_ids != 0).long()  # left-padded with pad id 0
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    print("image token", [round(v, 4) for v in out[0, 3, :3].tolist()])
