# eole-nlp/eole#169 (commit b5e2266, "fix batch inference").
# eole's SelfMHA, LM inference over a left-padded batch: at step 0 the layer cache
# is filled and, for left padding, the pad positions of the cache are zeroed using
# layer_cache[1]["key_pad_mask"]. Before the fix the *values* were zeroed; at the
# following decoding steps (no dec_mask, one query) the pad keys stayed as computed
# and kept their softmax weight. The fix zeroes the *keys* instead. The same commit
# dropped the "patch for scaled dot product attention" that re-opened fully masked
# rows of dec_mask (TransformerDecoderLayerBase._compute_dec_mask).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SelfMHA(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.dph = heads, d // heads
        self.linear_query = nn.Linear(d, d)
        self.linear_keys = nn.Linear(d, d)
        self.linear_values = nn.Linear(d, d)
        self.final_linear = nn.Linear(d, d)
        self.layer_cache = (False, {"keys": torch.tensor([]), "values": torch.tensor([])})

    def shape(self, x):
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.dph).transpose(1, 2)

    def forward(self, query, attn_mask=None, step=None):
        key = self.shape(self.linear_keys(query))
        value = self.shape(self.linear_values(query))
        query = self.shape(self.linear_query(query))
        if self.layer_cache[0]:
            if step > 0:
                key = torch.cat((self.layer_cache[1]["keys"], key), dim=2)
                value = torch.cat((self.layer_cache[1]["values"], value), dim=2)
            # mask for LM left padding by batch
            if step == 0:
                key_pad_mask = self.layer_cache[1].get("key_pad_mask", None)
                if key_pad_mask is not None:
                    if FIXED:
                        x = key_pad_mask.expand(-1, key.size(1), -1)
                        x = x.unsqueeze(3).expand(-1, -1, -1, key.size(3))
                        key = key.masked_fill(x, 0)
                    else:
                        x = key_pad_mask.expand(-1, value.size(1), -1)
                        x = x.unsqueeze(3)
                        x = x.expand(-1, -1, -1, value.size(3))
                        value = value.masked_fill(x, 0)
            self.layer_cache[1]["keys"] = key
            self.layer_cache[1]["values"] = value
        # eole: attn_mask True = keep for SDPA
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask.unsqueeze(1) if attn_mask is not None else None
        )
        b, h, t, dh = out.shape
        return self.final_linear(out.transpose(1, 2).reshape(b, t, h * dh))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.self_attn = SelfMHA(d, heads)
        self.post_attention_layernorm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def _compute_dec_mask(self, tgt_pad_mask, future):
        tgt_len = tgt_pad_mask.size(-1)
        if not future:
            future_mask = torch.ones([tgt_len, tgt_len], dtype=torch.uint8)
            future_mask = future_mask.tril_(0).bool()
            future_mask = ~future_mask.view(1, tgt_len, tgt_len)
            if not FIXED:
                # Patch for scaled dot product attention.
                patch_mask = ~torch.all(tgt_pad_mask + future_mask, dim=2, keepdim=True).expand_as(
                    tgt_pad_mask + future_mask
                )
            dec_mask = torch.gt(tgt_pad_mask + future_mask, 0)
            if not FIXED:
                dec_mask = torch.logical_and(dec_mask, patch_mask)
        else:
            dec_mask = tgt_pad_mask
        return dec_mask

    def forward(self, layer_in, tgt_pad_mask, step=None, future=False):
        dec_mask = None
        if layer_in.size(1) > 1:
            dec_mask = self._compute_dec_mask(tgt_pad_mask, future)
            dec_mask = ~dec_mask  # SDPA: True = attend
            # avoid all-masked rows (pad queries) producing NaN in SDPA
            dec_mask = dec_mask | ~dec_mask.any(-1, keepdim=True)
        norm = self.input_layernorm(layer_in)
        x = layer_in + self.self_attn(norm, attn_mask=dec_mask, step=step)
        return x + self.mlp(self.post_attention_layernorm(x))


class TransformerLMDecoder(nn.Module):
    def __init__(self, vocab, d=32, heads=4, layers=2, max_len=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.transformer_layers = nn.ModuleList([TransformerDecoderLayer(d, heads) for _ in range(layers)])
        self.layer_norm = nn.LayerNorm(d)
        self.generator = nn.Linear(d, vocab)

    def init_state(self):
        for layer in self.transformer_layers:
            layer.self_attn.layer_cache = (True, {"keys": torch.tensor([]), "values": torch.tensor([])})

    def forward(self, tgt, positions, step, pad_idx):
        emb = self.tok(tgt) + self.pos(positions)
        tgt_pad_mask = tgt.eq(pad_idx).unsqueeze(1)  # [B, 1, T]
        if step == 0:
            for layer in self.transformer_layers:
                layer.self_attn.layer_cache[1]["key_pad_mask"] = tgt_pad_mask
        x = emb
        for layer in self.transformer_layers:
            x = layer(x, tgt_pad_mask, step=step)
        return self.generator(self.layer_norm(x))


PAD = 0
model = TransformerLMDecoder(vocab=50).eval()
prompts = [[5, 9, 13, 7, 21, 3], [8, 17, 4]]
L = max(len(p) for p in prompts)
src = torch.tensor([[PAD] * (L - len(p)) + p for p in prompts])  # left padding
lengths = torch.tensor([len(p) for p in prompts])
positions = (torch.arange(L).unsqueeze(0) - (L - lengths).unsqueeze(1)).clamp(min=0)

model.init_state()
generated = []
with torch.no_grad():
    logits = model(src, positions, step=0, pad_idx=PAD)
    tok = logits[:, -1].argmax(-1, keepdim=True)
    generated.append(tok)
    pos = positions[:, -1:] + 1
    for step in range(1, 6):
        logits = model(tok, pos, step=step, pad_idx=PAD)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(tok)
        pos = pos + 1
out = torch.cat(generated, 1)
print("generated:", out.tolist())
print("last logits row 1:", [round(v, 4) for v in logits[1, -1, :5].tolist()])
