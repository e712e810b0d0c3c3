# deepspeedai/DeepSpeed#1912: since #1705 (e46d808a1) DeepSpeedSelfAttentionFunction overwrote input_mask with a dummy
# `torch.empty(1)`, so padded prompts were attended in generation; b4fcd98ff (#1899) removed the overwrite.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
VOCAB, HIDDEN, HEADS, LAYERS, PAD = 48, 32, 4, 2, 0
minus_inf = -10000.0


def softmax_context(qkv_out, input_mask, heads, norm_factor, triangular_masking=True):
    # stand-in for inference_cuda_module.softmax_context: a 1-element mask means "no mask"
    B, T, _ = qkv_out.shape
    q, k, v = qkv_out.view(B, T, 3, heads, -1).permute(2, 0, 3, 1, 4)
    scores = (q @ k.transpose(-1, -2)) * norm_factor
    if triangular_masking:
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), minus_inf)
    if input_mask.numel() > 1:
        scores = scores + input_mask
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v).transpose(1, 2).reshape(B, T, -1)


class DeepSpeedSelfAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, input_mask, attn_qkvw, attn_qkvb, attn_ow, attn_ob, heads):
        qkv_out = input @ attn_qkvw + attn_qkvb
        if FIXED:
            no_masking = input_mask is None
            if no_masking:
                input_mask = torch.empty(1)
        else:
            input_mask = torch.empty(1)  # dummy mask added for the fused kernel
        head_size = qkv_out.shape[-1] // 3 // heads
        context = softmax_context(qkv_out, input_mask, heads, 1.0 / head_size ** 0.5)
        return context @ attn_ow + attn_ob


class DeepSpeedTransformerInference(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_qkvw = nn.Parameter(torch.randn(HIDDEN, 3 * HIDDEN) * 0.2)
        self.attn_qkvb = nn.Parameter(torch.zeros(3 * HIDDEN))
        self.attn_ow = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.2)
        self.attn_ob = nn.Parameter(torch.zeros(HIDDEN))
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, hidden_states, attention_mask=None):
        attn = DeepSpeedSelfAttentionFunction.apply(self.norm(hidden_states), attention_mask, self.attn_qkvw,
                                                    self.attn_qkvb, self.attn_ow, self.attn_ob, HEADS)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(hidden_states)


class GPT2LMHeadModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(64, HIDDEN)
        self.h = nn.ModuleList(DeepSpeedTransformerInference() for _ in range(LAYERS))
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # GPT2Model: extended additive mask (1 - mask) * -10000 broadcast over heads and queries
        extended = (1.0 - attention_mask[:, None, None, :].float()) * minus_inf
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            x = block(x, attention_mask=extended)
        return self.lm_head(x)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens=4):
        for _ in range(max_new_tokens):
            next_tok = self(input_ids, attention_mask)[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, next_tok], 1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_tok)], 1)
        return input_ids


model = GPT2LMHeadModel().eval()
prompts = [[3, 4, 5, 6, 7, 8], [9, 10]]
width = max(map(len, prompts))
input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])  # left padding for generation
attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
out = model.generate(input_ids, attention_mask)
with torch.no_grad():
    padded_logits = model(input_ids, attention_mask)[1, -1]
    alone = torch.tensor([prompts[1]])
    alone_logits = model(alone, torch.ones_like(alone))[0, -1]
    alone_out = model.generate(alone, torch.ones_like(alone))
print(f"fixed={FIXED} padded gen={out[1, width:].tolist()} unpadded gen={alone_out[0, len(prompts[1]):].tolist()}")
print(f"max |next-token logits padded - unpadded| = {(padded_logits - alone_logits).abs().max().item():.4f}")
