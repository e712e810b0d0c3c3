# Citation: meta-pytorch/torchtune torchtune/modules/attention_utils.py (_get_document_ids_from_seq_lens,
#   create_block_causal_mask, packed_block_causal_mask, _sdpa_or_flex_attention) and torchtune/datasets/_packed.py
#   (PackedDataset: per-pack seq_lens, input_pos restarting per sample, padding as its own final "sequence").
# Samples are packed into fixed-length rows; the pad tail is recorded as one more entry of seq_lens so it forms its own
# causal block (no row is fully masked; its labels are -100). The flex path builds a BlockMask from
# mask_mod = (q_idx >= kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx]) (device switched to cpu here);
# the non-flex path gives the same thing as a bool keep mask block_diag(tril, ...) for SDPA. Flex runs a no-grad
# forward, SDPA (torchtune's path without CUDA flex support) runs the training step; the outputs are compared.
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)


def _get_document_ids_from_seq_lens(seq_lens):
    batch_size = len(seq_lens)
    batch_document_ids = []
    for sample_idx in range(batch_size):
        document_ids = torch.cat([
            torch.full((seq_len,), i, dtype=torch.long, device=seq_len.device)
            for i, seq_len in enumerate(seq_lens[sample_idx])])
        batch_document_ids.append(document_ids)
    batch_document_ids = torch.stack(batch_document_ids)
    return batch_document_ids


def create_block_causal_mask(seq_lens):
    batch_block_attn_masks = []
    batch_size = len(seq_lens)
    for sample_idx in range(batch_size):
        block_attn_masks = [torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool, device=seq_len.device))
                            for i, seq_len in enumerate(seq_lens[sample_idx])]
        batch_block_attn_masks.append(torch.block_diag(*block_attn_masks))
    return torch.stack(batch_block_attn_masks)


def packed_block_causal_mask(seq_lens, use_flex=True):
    if use_flex:
        document_ids = _get_document_ids_from_seq_lens(seq_lens)
        batch_size, max_seq_len = document_ids.shape

        def mask_mod(b, h, q_idx, kv_idx):
            causal_mask = q_idx >= kv_idx
            document_mask = document_ids[b, q_idx] == document_ids[b, kv_idx]
            return causal_mask & document_mask

        return create_block_mask(mask_mod, batch_size, None, max_seq_len, max_seq_len, device="cpu")
    else:
        return create_block_causal_mask(seq_lens=seq_lens)


class MultiHeadAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.output_proj = nn.Linear(dim, dim, bias=False)

    def _attention_call(self, q, k, v, mask):
        # _sdpa_or_flex_attention
        if isinstance(mask, torch.nn.attention.flex_attention.BlockMask):
            return flex_attention(q, k, v, block_mask=mask)
        if mask is not None:
            mask = mask[:, None, :, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=mask is None)

    def forward(self, x, mask, input_pos, rope):
        b, s, d = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_heads, self.head_dim)
        q, k = rope(q, input_pos), rope(k, input_pos)
        out = self._attention_call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, d))


def rope(x, input_pos, base=10000):
    d = x.shape[-1]
    theta = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    ang = input_pos[..., None].float() * theta                       # b s d/2
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


# PackedDataset with max_seq_len=32: each pack's seq_lens ends with the padding length
max_seq_len, vocab, dim = 32, 64, 32
packs = [[10, 14, 8], [20, 5, 7], [31, 1]]     # last entry of each pack is the pad block
tokens, labels, input_pos = [], [], []
for seq_lens in packs:
    t, l, p = [], [], []
    for j, n in enumerate(seq_lens):
        if j == len(seq_lens) - 1:
            t += [0] * n
            l += [-100] * n
            p += list(range(p[-1] + 1, p[-1] + 1 + n)) if p else list(range(n))
        else:
            ids = torch.randint(1, vocab, (n,)).tolist()
            t += ids
            l += ids[1:] + [-100]
            p += list(range(n))
    tokens.append(t), labels.append(l), input_pos.append(p)
tokens, labels, input_pos = torch.tensor(tokens), torch.tensor(labels), torch.tensor(input_pos)
seq_lens = [torch.tensor(s) for s in packs]

emb, attn, head = nn.Embedding(vocab, dim), MultiHeadAttention(dim, 4), nn.Linear(dim, vocab)
block_mask = packed_block_causal_mask(seq_lens, use_flex=True)
bool_mask = packed_block_causal_mask(seq_lens, use_flex=False)
h = emb(tokens)
with torch.no_grad():   # FlexAttention has no CPU backward: flex forward for evaluation only
    out_flex = attn(h, block_mask, input_pos, rope)
out_sdpa = attn(h, bool_mask, input_pos, rope)   # torchtune's CPU path (_SUPPORTS_FLEX_ATTENTION is False)
assert torch.allclose(out_flex, out_sdpa, atol=1e-5)
logits = head(h + out_sdpa)
loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
loss.backward()
print("packed flex loss %.4f" % loss.item())
