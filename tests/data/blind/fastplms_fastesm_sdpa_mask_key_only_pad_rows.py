# Synthyra/FastPLMs commit b535160 ("attn mask fix"), esm2/modeling_fastesm.py get_attention_mask (same change in
# esm_plusplus/modeling_esm_plusplus.py); follows Biohub/esm#299.
# Bug: on the SDPA backend the 4-D mask was the key padding row expanded over every query,
#   token_attention_mask[:, None, None, :].expand(batch_size, 1, seq_len, seq_len),
# so the padded query rows of a right-padded protein batch attend the real residues, unlike the flex backend's
# mask_mod (query & key).
# Fix: extended_attention_mask = token_attention_mask[:, None, :, None] & token_attention_mask[:, None, None, :].
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def get_attention_mask(
    attn_backend: str,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    attention_mask: Optional[torch.Tensor] = None,
):
    if attention_mask is None:
        token_attention_mask = torch.ones((batch_size, seq_len), device=device).bool()
    else:
        token_attention_mask = attention_mask.bool()
    flex_block_mask = None
    if FIXED:
        extended_attention_mask = token_attention_mask[:, None, :, None] & token_attention_mask[:, None, None, :]
    else:
        extended_attention_mask = token_attention_mask[:, None, None, :].expand(batch_size, 1, seq_len, seq_len)
    return extended_attention_mask, flex_block_mask


class EsmSelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        b, l, _ = hidden_states.shape
        x = self.LayerNorm(hidden_states)
        q, k, v = (t(x).view(b, l, self.num_heads, self.head_dim).transpose(1, 2) for t in (self.query, self.key, self.value))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        ctx = ctx.transpose(1, 2).reshape(b, l, -1)
        return hidden_states + self.dense(ctx)


class FastEsmModel(nn.Module):
    def __init__(self, vocab_size=33, hidden_size=32, num_heads=4, num_layers=2, pad_token_id=1):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.attn_backend = "sdpa"
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size, padding_idx=pad_token_id)
        self.layer = nn.ModuleList([EsmSelfAttention(hidden_size, num_heads) for _ in range(num_layers)])
        self.emb_layer_norm_after = nn.LayerNorm(hidden_size)

    def forward(self, input_ids, attention_mask=None):
        batch_size, seq_len = input_ids.shape
        x = self.word_embeddings(input_ids)
        extended_attention_mask, flex_block_mask = get_attention_mask(
            self.attn_backend, batch_size, seq_len, input_ids.device, attention_mask=attention_mask
        )
        for layer in self.layer:
            x = layer(x, attention_mask=extended_attention_mask)
        return self.emb_layer_norm_after(x)


def main():
    torch.manual_seed(0)
    model = FastEsmModel().eval()
    # <cls> M K T ... <eos>, right padded with <pad> = 1
    seqs = [[0, 20, 15, 11, 5, 8, 9, 2], [0, 20, 7, 13, 2]]
    L = max(len(s) for s in seqs)
    input_ids = torch.tensor([s + [1] * (L - len(s)) for s in seqs])
    attention_mask = (input_ids != 1).long()
    with torch.no_grad():
        last_hidden_state = model(input_ids, attention_mask=attention_mask)
    # per-residue embeddings of the whole padded batch (as the embedding datasets write them)
    print("last_hidden_state[1, :, 0]:", [round(v, 4) for v in last_hidden_state[1, :, 0].tolist()])
    print("mean over all positions of protein 1 (channel 0):", round(last_hidden_state[1, :, 0].mean().item(), 6))


if __name__ == "__main__":
    main()
