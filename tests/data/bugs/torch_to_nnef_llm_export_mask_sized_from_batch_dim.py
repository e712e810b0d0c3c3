"""torch-to-nnef LLM export: the forced causal mask is sized from the KV cache's batch dimension.

sonos/torch-to-nnef#217 ("correct causal mask + position_ids for transformers>4.52.4 export"),
written from the PR text (diff not read).
On the `force_causal_mask` path `DefaultArchitectureHandler.build_forward_inputs` sized the mask
from `inputs[1].shape[0]`; `inputs[1]` is the first past-key tensor [batch, heads, P, head_dim], so
the mask is a degenerate [1, 1]: the prompt pass runs without causal masking. Fix: S from input_ids,
P from the cache's sequence axis, and a [1, 1, S, S+P] additive mask from positions.
(The position_ids half of that fix is left out here: this small model has no rotary embedding.)
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyDecoder(nn.Module):
    """stands in for the HF causal LM: a 4D float mask is used as given"""

    def __init__(self, vocab=40, dim=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, past_key_values, attention_mask):
        h = self.emb(input_ids)
        B, S, D = h.shape
        present = []
        for i, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(h).view(B, S, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            pk, pv = past_key_values[2 * i], past_key_values[2 * i + 1]
            k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            present += [k, v]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
            h = h + o(a.transpose(1, 2).reshape(B, S, D))
        return self.head(h), present


class DefaultArchitectureHandler:
    def __init__(self, model):
        self.model = model

    def build_forward_inputs(self, inputs):
        input_ids, past = inputs[0], inputs[1:]
        if FIXED:
            S = input_ids.shape[1]
            P = inputs[1].shape[2]
            q_pos = torch.arange(P, P + S)[:, None]
            k_pos = torch.arange(S + P)[None, :]
            mask = torch.zeros(S, S + P).masked_fill(k_pos > q_pos, float("-inf"))
        else:
            S = inputs[1].shape[0]
            mask = torch.triu(torch.full((S, S), float("-inf")), diagonal=1)
        return input_ids, list(past), mask[None, None]

    def forward(self, *inputs):
        input_ids, past, mask = self.build_forward_inputs(inputs)
        return self.model(input_ids, past, mask)


def main():
    model = TinyDecoder().eval()
    handler = DefaultArchitectureHandler(model)
    prompt = torch.randint(0, 40, (1, 6))
    empty = [torch.zeros(1, 4, 0, 8) for _ in range(4)]
    with torch.no_grad():
        logits, present = handler.forward(prompt, *empty)  # prompt pass of the exported graph
        # reference: feed the prompt one token at a time (each step sees only the past)
        past, steps = empty, []
        for t in range(prompt.shape[1]):
            out, past = handler.forward(prompt[:, t : t + 1], *past)
            steps.append(out)
        ref = torch.cat(steps, 1)
    print(f"prompt-pass logits vs token-by-token, max |diff| = {(logits - ref).abs().max():.4f}")


if __name__ == "__main__":
    main()
