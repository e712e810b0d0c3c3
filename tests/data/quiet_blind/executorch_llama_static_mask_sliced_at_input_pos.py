"""ExecuTorch-style export decode: a precomputed causal mask buffer sliced at input_pos, static KV cache.

Follows pytorch/executorch, examples/models/llama/llama_transformer.py and attention.py (AttentionMHA: 
self.register_buffer("mask", torch.triu(torch.full((max_context_len, max_context_len), float("-inf")), 1));
forward with input_pos: attn_mask = self.mask[input_pos] ; KVCache.update writes k/v at input_pos; SDPA over the
whole max_seq_len cache with that mask). Commit: not pinned. Plain torch, SDPA with a float mask.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, MAX, V = 32, 4, 16, 40
HD = D // H


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Linear(D, D, bias=False)
        self.wk = torch.nn.Linear(D, D, bias=False)
        self.wv = torch.nn.Linear(D, D, bias=False)
        self.wo = torch.nn.Linear(D, D, bias=False)
        mask = torch.full((MAX, MAX), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        self.register_buffer("k_cache", torch.zeros(1, H, MAX, HD))
        self.register_buffer("v_cache", torch.zeros(1, H, MAX, HD))

    def forward(self, x, input_pos):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, H, HD).transpose(1, 2)
        k = self.wk(x).view(B, T, H, HD).transpose(1, 2)
        v = self.wv(x).view(B, T, H, HD).transpose(1, 2)
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        # rows of the causal mask for the positions being written: cache slots after them are -inf,
        # including the still-empty (zero) slots
        attn_mask = self.mask[input_pos]  # (T, MAX)
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=attn_mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class TinyLlama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(V, D)
        self.pos = torch.nn.Embedding(MAX, D)
        self.layers = torch.nn.ModuleList(Attention() for _ in range(2))
        self.head = torch.nn.Linear(D, V, bias=False)

    def forward(self, tokens, input_pos):
        x = self.tok(tokens) + self.pos(input_pos)[None]
        for layer in self.layers:
            x = x + layer(x, input_pos)
        return self.head(x)

    def full_forward(self, tokens):
        """Reference: no cache, plain causal attention over the tokens seen so far."""
        T = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(T))[None]
        for a in self.layers:
            q = a.wq(x).view(1, T, H, HD).transpose(1, 2)
            k = a.wk(x).view(1, T, H, HD).transpose(1, 2)
            v = a.wv(x).view(1, T, H, HD).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.wo(y.transpose(1, 2).reshape(1, T, D))
        return self.head(x)


model = TinyLlama().eval()
prompt = torch.tensor([[5, 9, 2, 17, 3]])

with torch.no_grad():
    # prefill at positions 0..P-1, then one token at a time at input_pos = [pos]
    logits = model(prompt, torch.arange(prompt.shape[1]))
    tokens = prompt
    pos = prompt.shape[1]
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    worst = (logits - model.full_forward(prompt)).abs().max().item()
    while pos < MAX:
        tokens = torch.cat([tokens, nxt], dim=1)
        step = model(nxt, torch.tensor([pos]))
        ref = model.full_forward(tokens)[:, -1:]
        worst = max(worst, (step - ref).abs().max().item())
        nxt = step[:, -1].argmax(-1, keepdim=True)
        pos += 1
print("generated:", tokens[0].tolist())
print("max |cached decode - full recompute| =", worst)
assert worst < 1e-5, worst
