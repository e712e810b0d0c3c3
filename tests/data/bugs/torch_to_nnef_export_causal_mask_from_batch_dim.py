"""torch-to-nnef LLM export wrapper built its forced causal mask from the batch axis.

Citation: sonos/torch-to-nnef PR #217 ("fix(llm): correct causal mask + position_ids for
transformers>4.52.4 export"), merged.  The PR description and the fixed
`ArchitectureHandler.build_causal_mask_with_past` / `DefaultArchitectureHandler.build_forward_inputs`
were read; the pre-fix body is reconstructed from the description ("built the attention mask
from `inputs[1].shape[0]` ... a degenerate `[1, 1]`: no causal masking and no past offset",
"a baked-diagonal triu").

Bug: on the `force_causal_mask` path (transformers > 4.52.4) the export wrapper takes the
exported inputs `(input_ids, k0, v0, k1, v1, ...)` and sized its mask from `inputs[1].shape[0]`.
`inputs[1]` is the first KV-cache tensor `[batch, heads, P, head_dim]`, so that is the batch
(1), and the triu mask is `[1, 1, 1, 1]` of zeros, which broadcasts to "attend everything":
the traced prefill of S new tokens over P past keys is non-causal.
Fix: S from `inputs[0].shape[1]`, P from `inputs[1].shape[2]`, and an additive `[1, 1, S, S+P]`
mask built from positions (key k masked for the query at absolute position P+i when k > P+i).

Reproduction: the wrapper's `build_forward_inputs` feeding a small decoder (past KV given as a
list, 4-D additive `attention_mask` passed to SDPA as in HF eager/sdpa when a 4-D mask is given),
with S=3 new tokens over P=2 cached positions, batch 1 — the shapes traced at export time.
"""
import sys
import typing as T
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class StateContext:
    model_inputs: T.Dict[str, T.Any]
    state: T.Dict[str, T.Any]


def build_causal_mask_with_past(*, seq_length, past_length, device):
    attn_mask_dtype = torch.float32
    neg = torch.finfo(attn_mask_dtype).min
    total_length = seq_length + past_length
    cache_position = torch.arange(past_length, total_length, device=device)
    position_ids = cache_position.unsqueeze(0)
    q_pos = cache_position.unsqueeze(1)
    k_pos = torch.arange(total_length).unsqueeze(0)
    future = (k_pos > q_pos).to(attn_mask_dtype)  # 1.0 where masked
    attention_mask = (torch.full([seq_length, total_length], neg) * future).unsqueeze(0).unsqueeze(0)
    return attention_mask, position_ids, cache_position


def build_forward_inputs(*, inputs, wrapper):
    attention_mask = None
    position_ids = None
    cache_position = None
    if getattr(wrapper, "force_causal_mask", False):
        if FIXED:
            attention_mask, position_ids, cache_position = build_causal_mask_with_past(
                seq_length=inputs[0].shape[1], past_length=inputs[1].shape[2], device=inputs[0].device)
        else:
            seq_length = inputs[1].shape[0]
            neg = torch.finfo(torch.float32).min
            attention_mask = torch.triu(torch.full([seq_length, seq_length], neg), diagonal=1)
            attention_mask = attention_mask.unsqueeze(0).unsqueeze(0)
    past_key_values = [(inputs[i], inputs[i + 1]) for i in range(1, len(inputs), 2)]
    model_inputs = {"input_ids": inputs[0], "past_key_values": past_key_values, "use_cache": True,
                    "attention_mask": attention_mask}
    if position_ids is not None:
        model_inputs["position_ids"] = position_ids
        model_inputs["cache_position"] = cache_position
    return StateContext(model_inputs=model_inputs, state={})


class TinyCausalLM(nn.Module):
    """One attention layer; with a 4-D mask given it is used as-is, else SDPA is_causal."""

    def __init__(self, vocab=32, hidden=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab)
        self.heads = heads

    def forward(self, input_ids, past_key_values, use_cache, attention_mask=None, position_ids=None,
                cache_position=None):
        x = self.embed(input_ids)
        b, s, h = x.shape
        shape = (b, s, self.heads, h // self.heads)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        past_k, past_v = past_key_values[0]
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
        logits = self.lm_head(out.transpose(1, 2).reshape(b, s, h))
        return {"logits": logits, "past_key_values": [(k, v)]}


def main():
    torch.manual_seed(0)
    model = TinyCausalLM().eval()
    wrapper = SimpleNamespace(force_causal_mask=True, with_dyn_cache=False)
    n_input_tokens, n_past_input_tokens = 3, 2
    input_ids = torch.randint(0, 32, (1, n_input_tokens))
    past = [torch.randn(1, 2, n_past_input_tokens, 8) for _ in range(2)]
    inputs = tuple([input_ids] + past)
    ctx = build_forward_inputs(inputs=inputs, wrapper=wrapper)
    with torch.no_grad():
        out = model(**ctx.model_inputs)
    print("mask shape", tuple(ctx.model_inputs["attention_mask"].shape),
          "logits[0,0,:3] =", [round(x, 4) for x in out["logits"][0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
