# foundation-model-stack (foundation-model-stack/foundation-model-stack commit 32bfbc8 "Fix non-zero pad error"): fms.utils.generation.pad_input_ids,
# run here with the fms GPT-BigCode (StarCoder) model. The padding mask was built from `pads.bool()`, the pad *fill value*, so with a
# non-zero pad_token_id (StarCoder's <fim_pad> = 4) pads were marked real and every query attended the left-pad keys.
import math
import sys
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def pad_input_ids(input_ids_list: List[torch.Tensor], min_pad_length: int = 0, is_causal_mask=True,
                  padding_side="left", position_ids_offset=0, pad_token_id=0):
    # fms/utils/generation.py
    max_len = max([min_pad_length] + [seq.size(0) for seq in input_ids_list])
    padded_input_ids_list, mask_list, position_ids_list = [], [], []
    for input_ids_i in input_ids_list:
        seq_len = input_ids_i.size(0)
        pads = torch.full((max_len - seq_len,), pad_token_id, dtype=torch.long, device=input_ids_i.device)
        non_pads = torch.ones(seq_len, dtype=torch.bool, device=input_ids_i.device)
        if FIXED:
            # Pad/real segmentation for the attention mask. This must be derived from token *position*
            is_pad = torch.zeros(max_len - seq_len, dtype=torch.bool, device=input_ids_i.device)
        pos_ids_pads = torch.zeros(max_len - seq_len, dtype=torch.long, device=input_ids_i.device)
        pos_ids_seq = torch.arange(0, seq_len, dtype=torch.long, device=input_ids_i.device)
        if padding_side == "left":
            padded_input_ids_list.append(torch.cat((pads, input_ids_i)))
            if FIXED:
                mask_list.append(torch.cat((is_pad, non_pads)))
            else:
                mask_list.append(torch.cat((pads.bool(), non_pads)))  # This will be False for pad tokens
            position_ids_list.append(torch.cat((pos_ids_pads, pos_ids_seq)))
        elif padding_side == "right":
            padded_input_ids_list.append(torch.cat((input_ids_i, pads)))
            if FIXED:
                mask_list.append(torch.cat((non_pads, is_pad)))
            else:
                mask_list.append(torch.cat((non_pads, pads.bool())))  # This will be False for pad tokens
            position_ids_list.append(torch.cat((pos_ids_seq, pos_ids_pads)))
        else:
            raise NotImplementedError("padding_side must be 'right' or left'")

    input_ids = torch.stack(padded_input_ids_list)
    padding_kwargs = {}
    mask = torch.stack(mask_list)
    mask = mask.unsqueeze(-1) == mask.unsqueeze(-2)
    # this is a causal mask for generation
    if is_causal_mask:
        mask = mask.tril()
    mask = torch.where(mask.logical_not(), -torch.inf, 0.0)
    padding_kwargs["mask"] = mask
    position_ids = torch.stack(position_ids_list)
    position_ids += position_ids_offset
    padding_kwargs["position_ids"] = position_ids
    return input_ids, padding_kwargs


class MultiHeadAttention(nn.Module):
    # fms/modules/attention.py, multi-query (kvheads=1) as GPTBigCodeBlock configures it, SDPA compute op
    def __init__(self, emb_dim, emb_kq, emb_v, nheads, kvheads):
        super().__init__()
        self.nheads, self.kvheads, self.emb_kq, self.emb_v = nheads, kvheads, emb_kq, emb_v
        self.in_proj = nn.Linear(emb_dim, (nheads + 2 * kvheads) * emb_kq, bias=True)  # fused qkv
        self.dense = nn.Linear(nheads * emb_v, emb_dim, bias=True)

    def forward(self, q, mask=None):
        b, s, _ = q.shape
        queries, keys, values = self.in_proj(q).split(
            [self.nheads * self.emb_kq, self.kvheads * self.emb_kq, self.kvheads * self.emb_v], dim=-1)
        queries = queries.view(b, s, self.nheads, self.emb_kq).transpose(1, 2)
        keys = keys.view(b, s, self.kvheads, self.emb_kq).transpose(1, 2)
        values = values.view(b, s, self.kvheads, self.emb_v).transpose(1, 2)
        expansion = self.nheads // self.kvheads
        keys = keys.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
        values = values.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
        if mask is not None:
            # Our expected mask format is bs x q_len x k_len, so to make it broadcastable
            while len(mask.size()) != 4:  # expects bs (x nheads) x q_len x kv_len
                mask = mask.unsqueeze(1)
        attn_mask = mask
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(dtype=queries.dtype)
        is_causal = mask is None and not (keys.shape[2] != 1 and queries.shape[2] == 1)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=attn_mask, dropout_p=0.0,
                                              is_causal=is_causal, scale=1 / math.sqrt(self.emb_kq))
        return self.dense(attn.transpose(1, 2).reshape(b, s, self.nheads * self.emb_v))


class GPTBigCodeBlock(nn.Module):
    def __init__(self, emb_dim, nheads):
        super().__init__()
        self.ln = nn.LayerNorm(emb_dim, 1e-5)
        self.ff_ln = nn.LayerNorm(emb_dim, 1e-5)
        self.attn = MultiHeadAttention(emb_dim, emb_dim // nheads, emb_dim // nheads, nheads, kvheads=1)
        self.ff_sub_layer = nn.Sequential(nn.Linear(emb_dim, 4 * emb_dim), nn.GELU(approximate="tanh"),
                                          nn.Linear(4 * emb_dim, emb_dim))

    def forward(self, x, mask=None):
        x = x + self.attn(self.ln(x), mask=mask)
        return x + self.ff_sub_layer(self.ff_ln(x))


class GPTBigCode(nn.Module):
    # fms/models/gpt_bigcode.py (tiny config, random weights, tied head)
    def __init__(self, src_vocab_size=64, emb_dim=64, nheads=4, nlayers=2, max_expected_seq_len=32):
        super().__init__()
        self.embedding = nn.Embedding(src_vocab_size, emb_dim)
        self.position_embedding = nn.Embedding(max_expected_seq_len, emb_dim)
        self.layers = nn.ModuleList([GPTBigCodeBlock(emb_dim, nheads) for _ in range(nlayers)])
        self.dec_norm = nn.LayerNorm(emb_dim, 1e-5)

    def forward(self, x, mask=None, position_ids=None):
        x = self.embedding(x) + self.position_embedding(position_ids)
        for layer in self.layers:
            x = layer(x, mask=mask)
        return self.dec_norm(x) @ self.embedding.weight.t()


FIM_PAD = 4  # StarCoder tokenizer: 0 <|endoftext|>, 1 <fim_prefix>, 2 <fim_middle>, 3 <fim_suffix>, 4 <fim_pad>
model = GPTBigCode().eval()
short = torch.tensor([1, 17, 23, 9, 3, 40, 2])                       # <fim_prefix> ... <fim_suffix> ... <fim_middle>
long = torch.tensor([1, 11, 12, 13, 14, 15, 16, 3, 30, 31, 32, 2])

with torch.no_grad():
    ids, kw = pad_input_ids([short, long], pad_token_id=FIM_PAD)         # batched generate() prefill, left padded
    batched = model(ids, mask=kw["mask"], position_ids=kw["position_ids"])[0, -1]
    ids1, kw1 = pad_input_ids([short], pad_token_id=FIM_PAD)            # the same prompt alone
    alone = model(ids1, mask=kw1["mask"], position_ids=kw1["position_ids"])[0, -1]
diff = (batched - alone).abs().max().item()
print(f"max |next-token logits(short prompt, left-padded in batch) - logits(alone)| = {diff:.6f}")
