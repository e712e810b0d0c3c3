# allenai/OLMo commit 6c4b8e15 ("Fix inverted context mask in attention impl"):
# OlmoLlamaBlock._scaled_dot_product_attention built the causal context mask inverted.
import math
import sys
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class ModelConfig:
    d_model = 32
    n_heads = 4
    n_layers = 2
    vocab_size = 64
    max_sequence_length = 16
    attention_dropout = 0.0


class OlmoLlamaBlock(nn.Module):
    def __init__(self, layer_id: int, config: ModelConfig):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.attn_norm = nn.LayerNorm(config.d_model)
        self.ff_norm = nn.LayerNorm(config.d_model)
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.ff_proj = nn.Linear(config.d_model, 4 * config.d_model, bias=False)
        self.ff_out = nn.Linear(4 * config.d_model, config.d_model, bias=False)

    @classmethod
    def _scaled_dot_product_attention(cls, q, k, v, attn_mask: Optional[torch.Tensor] = None,
                                      dropout_p: float = 0.0, is_causal: bool = False) -> torch.Tensor:
        if not FIXED:
            query_len, key_len = q.size(-2), k.size(-2)
            attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.size(-1))
            attn_bias = torch.zeros(query_len, key_len, dtype=q.dtype)
            if is_causal:
                assert attn_mask is None
                diagonal = key_len - query_len + 1
                context_mask = 1 - torch.triu(torch.ones_like(attn_bias, dtype=torch.int), diagonal=diagonal)
                attn_bias.masked_fill_(context_mask.bool(), torch.finfo(q.dtype).min)
        else:
            attn_weights = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            attn_bias = torch.zeros_like(attn_weights)
            if is_causal:
                assert attn_mask is None
                context_mask = torch.ones_like(attn_bias, dtype=torch.bool).tril(diagonal=0)
                attn_bias.masked_fill_(context_mask.logical_not(), torch.finfo(attn_bias.dtype).min)

        if attn_mask is not None:
            attn_bias += attn_mask.to(q.dtype)

        attn_weights += attn_bias
        attn_weights = nn.functional.softmax(attn_weights, dim=-1).to(q.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=dropout_p)
        return torch.matmul(attn_weights, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, T, self.config.n_heads, -1).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.config.n_heads, -1).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.config.n_heads, -1).transpose(1, 2)
        att = self._scaled_dot_product_attention(q, k, v, attn_mask=None,
                                                 dropout_p=self.config.attention_dropout, is_causal=True)
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attn_out(att)
        return x + self.ff_out(nn.functional.silu(self.ff_proj(self.ff_norm(x))))


class Olmo(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList([OlmoLlamaBlock(i, config) for i in range(config.n_layers)])
        self.ln_f = nn.LayerNorm(config.d_model)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        for block in self.blocks:
            x = block(x)
        return nn.functional.linear(self.ln_f(x), self.wte.weight)


def main():
    torch.manual_seed(0)
    config = ModelConfig()
    model = Olmo(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids = torch.randint(0, config.vocab_size, (2, config.max_sequence_length))

    # one training step of next-token prediction
    logits = model(input_ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, config.vocab_size), input_ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()

    # causality probe: change the last token, the logits of earlier positions must not move
    model.eval()
    with torch.no_grad():
        a = model(input_ids)
        changed = input_ids.clone()
        changed[:, -1] = (changed[:, -1] + 1) % config.vocab_size
        b = model(changed)
    leak = (a[:, :-1] - b[:, :-1]).abs().max().item()
    print(f"loss={loss.item():.4f}  max change of earlier logits when the last token changes: {leak:.6f}")


if __name__ == "__main__":
    main()
