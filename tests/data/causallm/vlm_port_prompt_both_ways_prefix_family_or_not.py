"""A hand-written vision-language port whose prompt pass (image patches, then the prompt's tokens) attends both ways,
then decodes one token at a time over the cache it wrote. Its attention layer is a class named `CausalAttention`.

Run as written, its config states `model_type = "paligemma"`: PaliGemma is a prefix-LM, its whole image + prompt
prefix attends both ways on purpose, and only the tokens it generates attend causally. Correct (the same structure as
ai-edge-torch's PaliGemma2 port after 45f18d2). With `--llava`, the same port states `model_type = "llava"`, a causal
VLM whose prompt attends causally: its prompt pass both ways is the causal mask dropped.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

FAMILY = "llava" if "--llava" in sys.argv else "paligemma"


class VLMConfig:
    model_type = FAMILY
    hidden = 32
    heads = 4
    vocab = 64
    patches = 4


class CausalAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads, self.dim = config.heads, config.hidden // config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.out = nn.Linear(config.hidden, config.hidden)
        self.cache = None

    def forward(self, x, bias):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.cache is not None:
            k, v = torch.cat([self.cache[0], k], dim=2), torch.cat([self.cache[1], v], dim=2)
        self.cache = (k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class VisionLanguageModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.patch = nn.Linear(12, config.hidden)
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(CausalAttention(config) for _ in range(2))
        self.head = nn.Linear(config.hidden, config.vocab)

    def forward(self, input_ids, pixel_values=None):
        x = self.embed(input_ids)
        if pixel_values is not None:  # the image's patches take the prompt's first slots
            x = torch.cat([self.patch(pixel_values), x[:, pixel_values.shape[1]:]], dim=1)
            bias = torch.zeros(x.shape[1], x.shape[1])  # the prompt pass: the whole prefix, both ways
        else:
            bias = None  # one new token over the cache: it sees every earlier key
        for layer in self.layers:
            x = x + layer(x, bias)
        return self.head(x)


torch.manual_seed(0)
config = VLMConfig()
model = VisionLanguageModel(config).eval()
tokens = torch.tensor([[1, 1, 1, 1, 5, 9, 12, 3]])
pixels = torch.randn(1, config.patches, 12)
with torch.no_grad():
    logits = model(tokens, pixel_values=pixels)
    generated = []
    for _ in range(3):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(int(nxt))
        logits = model(nxt)
print(FAMILY, "generated:", generated)
