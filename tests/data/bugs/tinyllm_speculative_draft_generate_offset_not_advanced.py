# skyzh/tiny-llm commit 4bd66e0 ("fix: draft-generate offset", PR skyzh/tiny-llm#83), src/tiny_llm_ref/generate.py.
# speculative_generate drafts num_drafts tokens with the small model, one decode step at a time over its
# TinyKvFullCache. draft_generate passed the same `offset` to every step, so each drafted token's query and key
# were rotated (RoPE, offset slice(offset, offset + L)) at the position of the first draft; the keys stored in the
# draft cache keep those wrong positions. The fix keeps a current_offset that advances by one per drafted token.
# Ported from MLX to torch: Qwen2-style attention with RoPE and a hand-written full KV cache with rewind.
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def causal_mask(L, S, dtype):
    mask = torch.tril(torch.ones(L, S), diagonal=S - L)
    return torch.where(mask.bool(), torch.tensor(0.0), torch.tensor(float("-inf"))).to(dtype)


class RoPE:
    def __init__(self, dims, seq_len, base=10000.0):
        inner = torch.arange(0, dims // 2, dtype=torch.float32) / (dims // 2)
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), 1.0 / (base ** inner))
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self.half = dims // 2

    def __call__(self, x, offset):
        # x: B, L, H, D
        cos = self.cos[offset[0]][None, :, None, :]
        sin = self.sin[offset[0]][None, :, None, :]
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyKvFullCache:
    def __init__(self):
        self.key_values = None
        self.offset = 0

    def update_and_fetch(self, key, value, mask_length=None, mask=None):
        if self.key_values is None:
            assert self.offset == 0
            self.key_values = (key, value)
            self.offset = key.shape[2]
            return key, value, self.offset, mask
        prev_keys, prev_values = self.key_values
        new_keys = torch.cat([prev_keys, key], dim=2)
        new_values = torch.cat([prev_values, value], dim=2)
        self.key_values = (new_keys, new_values)
        self.offset += key.shape[2]
        return new_keys, new_values, self.offset, mask

    def rewind(self, n):
        self.offset -= n
        self.key_values = (self.key_values[0][:, :, : self.offset], self.key_values[1][:, :, : self.offset])


class Qwen2MultiHeadAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_heads, max_seq_len=256):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.wq = torch.nn.Linear(hidden_size, hidden_size)
        self.wk = torch.nn.Linear(hidden_size, hidden_size)
        self.wv = torch.nn.Linear(hidden_size, hidden_size)
        self.wo = torch.nn.Linear(hidden_size, hidden_size, bias=False)
        self.rope = RoPE(self.head_dim, max_seq_len)

    def forward(self, x, offsets, cache, mask=None):
        B, L, _ = x.shape
        q = self.wq(x).reshape(B, L, self.num_heads, self.head_dim)
        k = self.wk(x).reshape(B, L, self.num_heads, self.head_dim)
        v = self.wv(x).reshape(B, L, self.num_heads, self.head_dim)
        offset_slice = [slice(int(offsets), int(offsets + L))]
        q = self.rope(q, offset=offset_slice).transpose(1, 2)
        k = self.rope(k, offset=offset_slice).transpose(1, 2)
        v = v.transpose(1, 2)
        k, v, S, mask = cache.update_and_fetch(k, v, mask_length=L, mask=mask)
        if mask == "causal":
            mask = causal_mask(L, S, torch.float32)
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5 + mask
        out = torch.softmax(scores, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(B, L, -1))


class Qwen2TransformerBlock(torch.nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.input_layernorm = torch.nn.RMSNorm(hidden_size)
        self.post_attention_layernorm = torch.nn.RMSNorm(hidden_size)
        self.self_attn = Qwen2MultiHeadAttention(hidden_size, num_heads)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden_size, 4 * hidden_size), torch.nn.SiLU(),
                                       torch.nn.Linear(4 * hidden_size, hidden_size))

    def forward(self, x, offset, cache, mask=None):
        h = x + self.self_attn(self.input_layernorm(x), offset, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2ModelWeek2(torch.nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_hidden_layers=2):
        super().__init__()
        self.num_hidden_layers = num_hidden_layers
        self.embedding = torch.nn.Embedding(vocab_size, hidden_size)
        self.layers_inner = torch.nn.ModuleList(
            [Qwen2TransformerBlock(hidden_size, num_heads) for _ in range(num_hidden_layers)])
        self.norm = torch.nn.RMSNorm(hidden_size)
        self.lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, inputs, offset, cache):
        h = self.embedding(inputs)
        for layer in range(self.num_hidden_layers):
            h = self.layers_inner[layer](h, offset, cache[layer], mask="causal")
        return self.lm_head(self.norm(h))


@torch.no_grad()
def speculative_generate(draft_model, model, prompt_ids, max_new_tokens=24):
    draft_kv_cache = [TinyKvFullCache() for _ in range(draft_model.num_hidden_layers)]
    kv_cache = [TinyKvFullCache() for _ in range(model.num_hidden_layers)]

    def _step(model, y, offset, kv_cache, n_tokens=1):
        logits = model(y[None], offset, kv_cache)
        if n_tokens > 1:
            logits = logits[:, -n_tokens:, :]
        else:
            logits = logits[:, -1, :]
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        y = torch.argmax(logprobs, dim=-1)
        return y, logprobs.squeeze(0)

    def _prefill(model, prompt_ids, kv_cache):
        prefill_tokens = torch.tensor(prompt_ids)
        token, _ = _step(model, prefill_tokens, 0, kv_cache)
        return token, prefill_tokens.numel()

    draft_token, draft_offset = _prefill(draft_model, prompt_ids, draft_kv_cache)
    token, offset = _prefill(model, prompt_ids, kv_cache)

    def draft_generate(model, last_token, offset, kv_cache, num_drafts):
        tokens = []
        current_offset = offset
        for _ in range(num_drafts):
            if FIXED:
                token, _ = _step(model, last_token, current_offset, kv_cache)
            else:
                token, _ = _step(model, last_token, offset, kv_cache)
            tokens.append(token.item())
            last_token = token
            current_offset += 1
        return tokens

    num_drafts = 4
    out, accepted = [], []
    while len(out) < max_new_tokens:
        draft_tokens = draft_generate(draft_model, token, draft_offset, draft_kv_cache, num_drafts)
        draft_offset += num_drafts
        draft_tokens = torch.cat([token, torch.tensor(draft_tokens)])
        new_tokens, _ = _step(model, draft_tokens, offset, kv_cache, num_drafts + 1)
        new_tokens = new_tokens.tolist()[0]
        offset += num_drafts + 1
        last_new_token = new_tokens[-1]
        new_tokens = torch.tensor([token.item()] + new_tokens[:-1])
        accept_all = True
        for i in range(len(new_tokens)):
            if new_tokens[i] != draft_tokens[i]:
                revert_len = len(draft_tokens) - i
                for layer in draft_kv_cache:
                    layer.rewind(revert_len - 1)
                draft_offset -= revert_len - 1
                for layer in kv_cache:
                    layer.rewind(revert_len)
                token = torch.tensor([new_tokens[i].item()])
                offset -= revert_len
                assert offset == draft_offset == kv_cache[0].offset
                accepted.append(i)
                accept_all = False
                break
            out.append(new_tokens[i].item())
        if accept_all:
            accepted.append(len(new_tokens))
            draft_generate(draft_model, draft_tokens[-1:], draft_offset, draft_kv_cache, 1)
            token = torch.tensor([last_new_token])
            draft_offset += 1
    return out, accepted


model = Qwen2ModelWeek2().eval()
draft_model = Qwen2ModelWeek2().eval()
draft_model.load_state_dict(model.state_dict())
with torch.no_grad():
    for p in draft_model.parameters():
        p.add_(0.01 * torch.randn_like(p))

prompt_ids = torch.randint(0, 64, (7,)).tolist()
tokens, accepted = speculative_generate(draft_model, model, prompt_ids)
print("generated:", tokens)
print("accepted per round:", accepted)
print("mean accepted:", sum(accepted) / len(accepted))
