# Follows salesforce/LAVIS lavis/models/blip2_models/Qformer.py BertModel.get_extended_attention_mask(is_decoder, has_query):
# UniLM mask where query rows see only queries (zeros over text) and text rows see all queries plus causal text, then
# (1 - mask) * -10000.0; Blip2Qformer.forward's ITG pass instead feeds text with past_key_values cached from the query pass.
import math
import torch
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, H, NQ = 32, 4, 8


def get_extended_attention_mask(attention_mask, input_shape, is_decoder, has_query=False):
    if is_decoder:
        batch_size, seq_length = input_shape
        seq_ids = torch.arange(seq_length)
        causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
        causal_mask = causal_mask.to(attention_mask.dtype)
        if causal_mask.shape[1] < attention_mask.shape[1]:
            prefix_seq_len = attention_mask.shape[1] - causal_mask.shape[1]
            if has_query:
                causal_mask = torch.cat([torch.zeros((batch_size, prefix_seq_len, seq_length), dtype=causal_mask.dtype),
                                         causal_mask], dim=1)
            causal_mask = torch.cat([torch.ones((batch_size, causal_mask.shape[1], prefix_seq_len), dtype=causal_mask.dtype),
                                     causal_mask], dim=-1)
        ext = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
    else:
        ext = attention_mask[:, None, None, :]
    return (1.0 - ext.to(torch.get_default_dtype())) * -10000.0


class QLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.cq, self.ck, self.cv, self.co = (nn.Linear(D, D) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def split(self, x):
        return x.view(x.shape[0], -1, H, D // H).transpose(1, 2)

    def attn(self, q, k, v, bias):
        s = q @ k.transpose(-1, -2) / math.sqrt(D // H) + bias
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(q.shape[0], -1, D)

    def forward(self, h, bias, query_length, image, past=None):
        q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        present = (k, v)
        h = self.ln1(h + self.o(self.attn(q, k, v, bias)))
        if query_length > 0:  # cross-attention to image only for the query part (layer_output for query tokens)
            hq = h[:, :query_length]
            c = self.attn(self.split(self.cq(hq)), self.split(self.ck(image)), self.split(self.cv(image)), 0.0)
            h = torch.cat([self.ln2(hq + self.co(c)), h[:, query_length:]], 1)
        return h, present


layers = nn.ModuleList([QLayer() for _ in range(2)]).eval()
B, T = 3, 6
query_tokens = torch.randn(1, NQ, D).expand(B, -1, -1)
image = torch.randn(B, 5, D)
text = torch.randn(B, T, D)
text_mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 1 + [0] * 5])  # right padded
query_atts = torch.ones(B, NQ, dtype=torch.long)
with torch.no_grad():
    # (a) one joint pass with the UniLM mask
    am = torch.cat([query_atts, text_mask], 1)
    bias = get_extended_attention_mask(am, (B, T), True, has_query=True)  # UniLM: queries see only queries
    h = torch.cat([query_tokens, text], 1)
    for layer in layers:
        h, _ = layer(h, bias, NQ, image)
    joint_q, joint_t = h[:, :NQ], h[:, NQ:]
    # (b) ITG style: query pass (bidirectional, no text), cache its k/v, then text with past_key_values
    hq, pasts = query_tokens, []
    for layer in layers:
        hq, present = layer(hq, get_extended_attention_mask(query_atts, (B, NQ), False), NQ, image)
        pasts.append(present)
    ht = text
    text_bias = get_extended_attention_mask(am, (B, T), True)  # [query_atts, text mask]: prefix ones + causal text
    for layer, past in zip(layers, pasts):
        ht, _ = layer(ht, text_bias, 0, image, past=past)
    diff = max((joint_q - hq).abs().max().item(),
               max((joint_t[b, :int(text_mask[b].sum())] - ht[b, :int(text_mask[b].sum())]).abs().max().item() for b in range(B)))
    # (c) per-example, unpadded text, explicit per-query loop over queries + text[:i+1]
    for b in range(B):
        L = int(text_mask[b].sum())
        hb = torch.cat([query_tokens[b:b + 1], text[b:b + 1, :L]], 1)
        for layer in layers:
            q, k, v = layer.split(layer.q(hb)), layer.split(layer.k(hb)), layer.split(layer.v(hb))
            rows = []
            for i in range(NQ + L):
                keys = list(range(NQ)) if i < NQ else list(range(i + 1))
                rows.append(layer.attn(q[:, :, i:i + 1], k[:, :, keys], v[:, :, keys], 0.0))
            hb = layer.ln1(hb + layer.o(torch.cat(rows, 1)))
            hqb = hb[:, :NQ]
            c = layer.attn(layer.split(layer.cq(hqb)), layer.split(layer.ck(image[b:b + 1])), layer.split(layer.cv(image[b:b + 1])), 0.0)
            hb = torch.cat([layer.ln2(hqb + layer.co(c)), hb[:, NQ:]], 1)
        diff = max(diff, (joint_q[b:b + 1] - hb[:, :NQ]).abs().max().item(), (joint_t[b:b + 1, :L] - hb[:, NQ:]).abs().max().item())
print("max |UniLM joint pass - cached ITG pass - per-query loop| =", diff)
assert diff < 1e-10
