# nishide-dev/unturtle#59 (refs #57): the BD3LM block-diffusion sampler ignored attention_mask and inferred padding
# from x != pad_id, so prompt tokens equal to pad_id (pad == eos chat templates) were cut out of the block mask.
import sys

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
VOCAB, HIDDEN, HEADS = 40, 32, 4
MASK_ID, PAD_ID, EOS_ID = 39, 2, 2  # tokenizer.pad_token = tokenizer.eos_token


def _prepare_for_sampling(x, block_size, pad_token_id, valid_mask=None):
    """Block-wise bidirectional attention mask [B,1,T,T] (bool) and position_ids over prompt + generated."""
    B, T = x.shape
    valid = x != pad_token_id if valid_mask is None else valid_mask.bool()
    pos_raw = torch.cumsum(valid.long(), dim=-1)
    position_ids = torch.where(valid, pos_raw - 1, torch.zeros_like(pos_raw))
    block_ids = (torch.arange(T) // block_size).view(1, T).expand(B, -1)
    block_ids = torch.where(valid, block_ids, torch.full_like(block_ids, -1))
    bid_q, bid_k = block_ids.view(B, 1, T, 1), block_ids.view(B, 1, 1, T)
    attn_mask = (bid_k <= bid_q) & (bid_q >= 0) & (bid_k >= 0)
    attn_mask = attn_mask | ~attn_mask.any(-1, keepdim=True)  # pad-safe: all-False rows attend everywhere
    return attn_mask, position_ids


class A2DLlamaFlexAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)
        self.is_causal = False

    def forward(self, h, block_mask):
        B, T, _ = h.shape
        q, k, v = self.qkv(h).view(B, T, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        out = flex_attention(q, k, v, block_mask=block_mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, HIDDEN))


class A2DLlamaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.embed_positions = nn.Embedding(64, HIDDEN)
        self.layers = nn.ModuleList([A2DLlamaFlexAttention() for _ in range(2)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask, position_ids):
        B, T = input_ids.shape
        dense = attention_mask[:, 0]  # [B, T, T] bool, built by the sampler

        def mask_mod(b, h, q_idx, kv_idx):
            return dense[b, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, B=B, H=None, Q_LEN=T, KV_LEN=T, device="cpu")
        h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for layer in self.layers:
            h = h + layer(self.norm(h), block_mask)
        return self.lm_head(h)


@torch.no_grad()
def sample_block_diffusion(model, inputs, attention_mask=None, block_size=4, max_new_tokens=4, steps=2):
    B = len(inputs)
    max_prompt_len = max(len(p) for p in inputs)
    padded_prompt_len = ((max_prompt_len + block_size - 1) // block_size) * block_size
    x = torch.full((B, padded_prompt_len), PAD_ID, dtype=torch.long)
    canvas_valid = torch.zeros((B, padded_prompt_len), dtype=torch.bool)
    for b, p in enumerate(inputs):
        x[b, padded_prompt_len - len(p):] = p
        if attention_mask is not None:
            canvas_valid[b, padded_prompt_len - len(p):] = attention_mask[b, max_prompt_len - len(p):].bool()
    x = torch.cat([x, torch.full((B, max_new_tokens), MASK_ID)], dim=1)
    canvas_valid = torch.cat([canvas_valid, torch.ones((B, max_new_tokens), dtype=torch.bool)], dim=1)
    first_logits = None
    for _ in range(steps):
        if FIXED and attention_mask is not None:
            attn, pos = _prepare_for_sampling(x, block_size, PAD_ID, valid_mask=canvas_valid)
        else:
            attn, pos = _prepare_for_sampling(x, block_size, PAD_ID)
        logits = model(x, attn, pos)
        first_logits = logits if first_logits is None else first_logits
        blk = x[:, -max_new_tokens:]
        conf, pred = logits[:, -max_new_tokens:].softmax(-1).max(-1)
        conf = conf.masked_fill(blk != MASK_ID, -1.0)
        idx = conf.topk(max_new_tokens // steps, dim=-1).indices
        blk.scatter_(1, idx, pred.gather(1, idx))
    return x, first_logits


model = A2DLlamaModel().eval()
# chat prompt whose earlier turn ends with <eos> (== pad), left-padded in a batch with a longer prompt
prompt_a = torch.tensor([5, 6, 7, EOS_ID, 8, 9])
prompt_b = torch.tensor([11, 12, 13, 14, 15, 16, 17])
attention_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
out, logits = sample_block_diffusion(model, [prompt_a, prompt_b], attention_mask)

# reference: the same canvas with every prompt token treated as real
ref_x = torch.cat([torch.full((1, 2), PAD_ID), prompt_a[None], torch.full((1, 4), MASK_ID)], 1)
ref_valid = torch.tensor([[0, 0] + [1] * 10]).bool()
ref_attn, ref_pos = _prepare_for_sampling(ref_x, 4, PAD_ID, valid_mask=ref_valid)
with torch.no_grad():
    ref_logits = model(ref_x, ref_attn, ref_pos)
diff = (logits[0, -4:] - ref_logits[0, -4:]).abs().max().item()
print(f"fixed={FIXED} generated block vs prompt-with-eos reference, max |logit diff| = {diff:.4f}")
print("block:", out[0, -4:].tolist())
