# nishide-dev/unturtle#43: Dream (diffusion LM) eager attention did `attn_weights + attention_mask` with the bool
# [B,1,L,L] keep-mask built by DreamGenerationMixin._sample, adding +1/+0 instead of -inf, so padding was attended.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

VOCAB, HIDDEN, HEADS, LAYERS, MASK_ID, PAD_ID = 64, 32, 4, 2, 63, 0


def _apply_eager_attention_mask(attn_weights, attention_mask):
    if isinstance(attention_mask, str) and attention_mask == "full":
        return attn_weights
    if attention_mask.dtype == torch.bool:
        return attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
    return attn_weights + attention_mask


class DreamAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.head_dim = HIDDEN // HEADS
        self.is_causal = False  # Dream is a bidirectional masked-diffusion model
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if FIXED:
            attn_weights = _apply_eager_attention_mask(attn_weights, attention_mask)
        elif attention_mask is not None and not isinstance(attention_mask, str):  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : k.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, HIDDEN)
        return self.o_proj(out)


class DreamDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = DreamAttention()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.SiLU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, h, attention_mask):
        h = h + self.self_attn(self.input_layernorm(h), attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DreamModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.embed_positions = nn.Embedding(64, HIDDEN)
        self.layers = nn.ModuleList([DreamDecoderLayer() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, attention_mask="full", tok_idx=None):
        if tok_idx is None:
            tok_idx = torch.arange(input_ids.shape[1]).unsqueeze(0)
        h = self.embed_tokens(input_ids) + self.embed_positions(tok_idx)
        for layer in self.layers:
            h = layer(h, attention_mask)
        return self.lm_head(self.norm(h))


@torch.no_grad()
def diffusion_sample(model, input_ids, attention_mask, max_length, steps=3):
    """DreamGenerationMixin._sample reduced: fill with [MASK], unmask the most confident tokens each step."""
    x = F.pad(input_ids, (0, max_length - input_ids.shape[1]), value=MASK_ID)
    if attention_mask is not None and torch.any(attention_mask == 0.0):
        attention_mask = F.pad(attention_mask, (0, max_length - attention_mask.shape[1]), value=1.0)
        tok_idx = attention_mask.long().cumsum(-1) - 1
        tok_idx.masked_fill_(attention_mask == 0, 1)
        attention_mask = torch.logical_and(
            attention_mask.unsqueeze(1).unsqueeze(-2).bool(),
            attention_mask.unsqueeze(1).unsqueeze(-1).bool(),
        )
    else:
        tok_idx = None
        attention_mask = "full"
    first_logits = None
    for _ in range(steps):
        logits = model(x, attention_mask, tok_idx)
        if first_logits is None:
            first_logits = logits
        mask_index = x == MASK_ID
        conf, pred = logits.softmax(-1).max(-1)
        conf = conf.masked_fill(~mask_index, -1.0)
        idx = conf.topk(2, dim=-1).indices
        x.scatter_(1, idx, pred.gather(1, idx))
    return x, first_logits


model = DreamModel().eval()
prompt_a = torch.randint(1, 60, (1, 6))
prompt_b = torch.randint(1, 60, (1, 3))
# left-padded batch, as the tokenizer produces for generation
input_ids = torch.cat([prompt_a, torch.cat([torch.full((1, 3), PAD_ID), prompt_b], 1)], 0)
attention_mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])

out, logits = diffusion_sample(model, input_ids, attention_mask, max_length=12)
_, ref_logits = diffusion_sample(model, prompt_b, None, max_length=9)
diff = (logits[1, 3:] - ref_logits[0]).abs().max().item()
print(f"fixed={FIXED} padded-row vs unpadded prompt, max |logit diff| = {diff:.4f}")
print("generated:", out[1, 3:].tolist())
