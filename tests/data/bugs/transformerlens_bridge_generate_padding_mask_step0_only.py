# TransformerLensOrg/TransformerLens#1617: TransformerBridge.generate() absorbed a caller's attention_mask into
# **multimodal_kwargs, which are merged into the forward kwargs on step 0 only, so cached decode steps of a
# left-padded prompt attended to the pad slots (and took position_ids = total_len - 1, counting the pads).
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyCausalLM(nn.Module):
    """HF-style decoder: forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None)."""

    def __init__(self, vocab=50, d=32, heads=4, layers=2, max_pos=64):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_pos, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None):
        b, s = input_ids.shape
        past = past_key_values[0][0].shape[2] if past_key_values else 0
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past : past + s]
        elif position_ids is None:
            position_ids = torch.arange(past, past + s).expand(b, s)
        x = self.wte(input_ids) + self.wpe(position_ids)
        total = past + s
        q_pos = torch.arange(past, total).view(-1, 1)
        mask = (torch.arange(total).view(1, -1) <= q_pos)[None, None]  # causal
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, :total].bool()
        presents = []
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(x).view(b, s, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)
            if past_key_values:
                k = torch.cat([past_key_values[i][0], k], 2)
                v = torch.cat([past_key_values[i][1], v], 2)
            presents.append((k, v))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + o(a.transpose(1, 2).reshape(b, s, -1))
        return self.lm_head(x), presents


class TransformerBridge:
    def __init__(self, model):
        self.model = model

    def generate(self, input, max_new_tokens=4, **multimodal_kwargs):
        attention_mask = multimodal_kwargs.pop("attention_mask", None) if FIXED else None
        tokens, past, step_logits = input, None, []
        for step in range(max_new_tokens):
            if step == 0:
                kwargs = dict(multimodal_kwargs)  # merged into the forward kwargs on step 0 only
                if attention_mask is not None:
                    kwargs["attention_mask"] = attention_mask
                logits, past = self.model(tokens, past_key_values=None, **kwargs)
            else:
                total_len = tokens.shape[1]
                if attention_mask is not None:
                    attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], -1)
                    pos = attention_mask.sum(-1, keepdim=True) - 1
                    logits, past = self.model(tokens[:, -1:], attention_mask=attention_mask, position_ids=pos,
                                              past_key_values=past)
                else:
                    pos = torch.full((tokens.shape[0], 1), total_len - 1)
                    logits, past = self.model(tokens[:, -1:], position_ids=pos, past_key_values=past)
            step_logits.append(logits[:, -1])
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens, torch.stack(step_logits, 1)


def main():
    bridge = TransformerBridge(TinyCausalLM().eval())
    prompt = torch.tensor([[11, 23, 5, 42]])
    pad = 0
    padded = torch.cat([torch.full((1, 3), pad), prompt], dim=1)  # pre-padded (left) prompt
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        ref_tokens, ref_logits = bridge.generate(prompt, max_new_tokens=4)
        tokens, logits = bridge.generate(padded, max_new_tokens=4, attention_mask=mask)
    diff = (logits[:, 1:] - ref_logits[:, 1:]).abs().max().item()  # decode steps after step 0
    print(f"fixed={FIXED} max |cached-step logits (padded) - unpadded| = {diff:.6f}; "
          f"tokens {tokens[0, 7:].tolist()} vs {ref_tokens[0, 4:].tolist()}")


if __name__ == "__main__":
    main()
