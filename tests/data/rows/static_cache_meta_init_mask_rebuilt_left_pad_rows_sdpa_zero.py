# Correct (quiet): a decoder with a static KV cache and a causal bool mask buffer, built on the meta device and
# materialised for export with every buffer zero-filled and each layer's mask rebuilt where the layer has one
# (hasattr, as executorch 07b7c7e does). The batch is left-padded, so the pad queries of row 1 see no key under
# causal & padding: F.scaled_dot_product_attention gives those rows 0, and their outputs are never read.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
CFG = {"vocab": 40, "dim": 32, "heads": 4, "layers": 2, "max_len": 10, "batch": 2}


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.h, self.d = c["heads"], c["dim"] // c["heads"]
        self.wqkv, self.wo = nn.Linear(c["dim"], 3 * c["dim"]), nn.Linear(c["dim"], c["dim"])
        self.register_buffer("k_cache", torch.zeros(c["batch"], self.h, c["max_len"], self.d))
        self.register_buffer("v_cache", torch.zeros(c["batch"], self.h, c["max_len"], self.d))
        self.register_buffer("mask", torch.ones(c["max_len"], c["max_len"], dtype=torch.bool).tril())

    def forward(self, x, input_pos, key_real):  # key_real: (B, max_len) bool, False at pad slots
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, self.d).transpose(1, 2) for t in self.wqkv(x).chunk(3, -1))
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        attn_mask = self.mask[input_pos][None, None] & key_real[:, None, None, :]
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=attn_mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class Decoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = nn.Embedding(c["vocab"], c["dim"])
        self.attn = nn.ModuleList(Attention(c) for _ in range(c["layers"]))
        self.head = nn.Linear(c["dim"], c["vocab"])

    def forward(self, tokens, input_pos, key_real):
        x = self.embed(tokens)
        for layer in self.attn:
            x = x + layer(x, input_pos, key_real)
        return self.head(x)


reference = Decoder(CFG).eval()
params = {n: p.detach().clone() for n, p in reference.named_parameters()}
with torch.device("meta"):
    model = Decoder(CFG)
model.load_state_dict(params, strict=False, assign=True)
for fqn, buf in list(model.named_buffers()):
    parent_name, name = fqn.rsplit(".", 1)
    model.get_submodule(parent_name).register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype))
for layer in model.attn:
    if hasattr(layer, "mask"):
        layer.register_buffer("mask", torch.ones(CFG["max_len"], CFG["max_len"], dtype=torch.bool).tril())
model.eval()

prompt = torch.tensor([[5, 9, 3, 17, 8], [0, 0, 12, 4, 30]])  # row 1 left-padded with 0
key_real = torch.ones(2, CFG["max_len"], dtype=torch.bool)
key_real[:, :5] = prompt.ne(0)
with torch.no_grad():
    logits = model(prompt, torch.arange(5), key_real)
    tok = logits[:, -1:].argmax(-1)
    for i in range(3):
        logits = model(tok, torch.tensor([5 + i]), key_real)
        tok = logits[:, -1:].argmax(-1)
print("last tokens:", tok.flatten().tolist())
