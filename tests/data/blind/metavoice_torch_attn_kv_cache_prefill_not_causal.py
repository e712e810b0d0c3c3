# metavoiceio/metavoice-src#46 (commit 43f97a0) and #62 (commit d1cd125, "feat: fix bug"), fam/llm/layers/attn.py.
#
# MetaVoice's first-stage GPT (fam/llm/model.py, fam/llm/layers/{attn,combined,layers}.py, fam/llm/mixins/causal.py,
# read at 43f97a0^) samples with a KV cache: `_sample_batch` first feeds the whole prompt (kv_cache_first_empty_index
# == 0), then one token a step.  `SelfAttention._torch_attn` called F.scaled_dot_product_attention with
# `is_causal=self.causal and (self.kv_cache_enabled is not True)`, so with the cache on, the prompt pass ran with no
# causal mask: every prompt token saw the ones after it, and those keys/values went into the cache later steps read.
# #46 changed the flag to `... or self.kv_cache_first_empty_index == 0` but still tested it after `_update_kv_cache`
# had advanced the index; #62 (d1cd125) computes `is_causal_attn_mask` before the cache update, which is the fix run
# by --fixed.
#
# Port trimmed to the torch_attn kernel, one prompt length per batch, no speaker embedding, no guidance; tiny sizes,
# random weights.  The cache is kept in the model's dtype (upstream allocates bfloat16 and runs under autocast).
import math
import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_sizes: list = field(default_factory=list)
    target_vocab_sizes: Optional[list] = None
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    causal: bool = True
    norm_type: str = "layernorm"
    nonlinearity_type: str = "gelu"
    attn_kernel_type: Literal["fa2", "torch_attn", "hand"] = "torch_attn"
    kv_cache_enabled: bool = False


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden_dim = 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden_dim, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden_dim, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "Embedding dimension must be divisible by number of heads"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.causal = config.causal
        self.attn_kernel_type = config.attn_kernel_type
        self.kv_cache_enabled = False

    def empty_kv_cache(self, batch_size: int, kv_cache_maxlen: int, dtype: torch.dtype):
        if self.kv_cache_enabled is False:
            raise Exception("Trying to empty KV cache when it is disabled")
        self.register_buffer(
            "kv_cache",
            torch.zeros(
                2,
                batch_size,
                kv_cache_maxlen,
                self.n_head,
                self.n_embd // self.n_head,
                dtype=dtype,
                device=self.c_attn.weight.device,
            ),
            persistent=False,
        )
        self.kv_cache_first_empty_index = 0

    def _update_kv_cache(self, q, k, v):
        q_time, k_time, v_time = q.shape[1], k.shape[1], v.shape[1]

        if self.kv_cache_first_empty_index == 0:
            assert q_time == k_time and q_time == v_time
        else:
            assert q_time == 1, f"Only one query at a time is supported, but got q_time={q_time}"

        self.kv_cache[0, :, self.kv_cache_first_empty_index : self.kv_cache_first_empty_index + q_time] = k
        self.kv_cache[1, :, self.kv_cache_first_empty_index : self.kv_cache_first_empty_index + q_time] = v
        self.kv_cache_first_empty_index += q_time

        k = self.kv_cache[0, :, : self.kv_cache_first_empty_index]
        v = self.kv_cache[1, :, : self.kv_cache_first_empty_index]

        return k, v

    def _torch_attn(self, c_x: torch.Tensor) -> torch.Tensor:
        q, k, v = c_x.split(1, dim=2)  # q, k, v of shape (B, T, 1, nh, hs)
        q = q.squeeze(2)  # (B, T, nh, hs)
        k = k.squeeze(2)  # (B, T, nh, hs)
        v = v.squeeze(2)  # (B, T, nh, hs)

        if FIXED:
            # calculate this before updating kv_caching so we have the right value for kv_cache_first_empty_index
            is_causal_attn_mask = self.causal and (not self.kv_cache_enabled or self.kv_cache_first_empty_index == 0)
        else:
            is_causal_attn_mask = self.causal and (self.kv_cache_enabled is not True)

        if self.kv_cache_enabled:
            k, v = self._update_kv_cache(q, k, v)

        q = q.transpose(1, 2)  # (B, nh, T, hs)
        k = k.transpose(1, 2)  # (B, nh, T, hs)
        v = v.transpose(1, 2)  # (B, nh, T, hs)
        y = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None,
            dropout_p=self.dropout if self.training else 0,
            is_causal=is_causal_attn_mask,
        ).transpose(1, 2)  # (B, nh, T, hs) -> (B, T, nh, hs)

        return y

    def forward(self, x):
        B, T, C = x.size()
        c_x = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)  # (B, T, 3, nh, hs)
        if self.attn_kernel_type == "torch_attn":
            y = self._torch_attn(c_x)
        else:
            raise Exception(f"Unknown attention kernel type: {self.attn_kernel_type}")
        y = y.contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = SelfAttention(config)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.kv_cache_enabled = False
        self.kv_pos = 0
        self.transformer = nn.ModuleDict(
            dict(
                wtes=nn.ModuleList([nn.Embedding(vsize, config.n_embd) for vsize in config.vocab_sizes]),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_heads = nn.ModuleList()
        for vsize in config.vocab_sizes:
            self.lm_heads.append(nn.Linear(config.n_embd, vsize, bias=False))
        for i in range(len(config.vocab_sizes)):
            self.lm_heads[i].weight = self.transformer.wtes[i].weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        device = idx.device
        b, num_hierarchies, t = idx.size()
        assert t <= self.config.block_size

        if self.kv_cache_enabled:
            if self.kv_pos == 0:
                pos = torch.arange(0, t, dtype=torch.long, device=device)
                self.kv_pos += t
            else:
                assert t == 1, "KV cache is only supported for single token inputs"
                pos = torch.tensor([self.kv_pos], dtype=torch.long, device=device)  # shape (1)
                self.kv_pos += 1
        else:
            pos = torch.arange(0, t, dtype=torch.long, device=device)  # shape (t)

        tok_emb = torch.zeros((b, t, self.config.n_embd), device=device)
        for i, wte in enumerate(self.transformer.wtes):
            tok_emb += wte(idx[:, i, :])
        pos_emb = self.transformer.wpe(pos)

        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        list_logits = [lm_head(x[:, [-1], :]) for lm_head in self.lm_heads]
        return list_logits, None

    # --- fam/llm/mixins/causal.py (CausalInferenceMixin) ---
    def enable_kv_cache(self):
        self.kv_cache_enabled = True
        for block in self.transformer.h:
            block.attn.kv_cache_enabled = True

    def empty_kv_cache(self, *, batch_size: int, kv_cache_maxlen: int, dtype: torch.dtype):
        self.kv_pos = 0
        for block in self.transformer.h:
            block.attn.empty_kv_cache(batch_size=batch_size, kv_cache_maxlen=kv_cache_maxlen, dtype=dtype)

    def _sample_next_token(self, *, idx, temperature, top_k):
        idx_cond = idx if idx.size(-1) <= self.config.block_size else idx[:, :, -self.config.block_size :]
        list_logits, _ = self(idx_cond)
        list_logits = [logits[:, -1, :] / temperature for logits in list_logits]
        if top_k is not None:
            for i in range(len(list_logits)):
                logits = list_logits[i]
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
                list_logits[i] = logits
        probs = [F.softmax(logits, dim=-1) for logits in list_logits]
        idx_next = [torch.multinomial(prob, num_samples=1) for prob in probs]
        return torch.cat(idx_next, dim=-1), list_logits

    @torch.no_grad()
    def _sample_batch(self, *, idx, max_new_tokens, temperature, top_k):
        min_seq_lens = idx.shape[-1]
        first_logits = None
        for timestep in range(min_seq_lens, min_seq_lens + max_new_tokens):
            if (self.kv_cache_enabled is True) and (timestep > min_seq_lens):
                idx_input = idx[:, :, -1:]
            else:
                idx_input = idx
            idx_next, list_logits = self._sample_next_token(idx=idx_input, temperature=temperature, top_k=top_k)
            if first_logits is None:
                first_logits = list_logits[0]
            idx = torch.cat((idx, idx_next.unsqueeze(-1)), dim=2)
        return idx, first_logits


def main():
    torch.manual_seed(0)
    config = GPTConfig(block_size=64, vocab_sizes=[96, 96], n_layer=3, n_head=4, n_embd=64, attn_kernel_type="torch_attn")
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)

    prompt = torch.randint(0, 96, (2, 2, 10))
    model.enable_kv_cache()
    model.empty_kv_cache(batch_size=prompt.shape[0], kv_cache_maxlen=config.block_size, dtype=torch.float32)
    torch.manual_seed(1)
    out, first_logits = model._sample_batch(idx=prompt, max_new_tokens=8, temperature=1.0, top_k=1)
    print("first-step top logits:", first_logits.max(dim=-1).values)
    print("generated hierarchy-0 tokens:", out[:, 0, prompt.shape[-1]:].tolist())
    print("generated hierarchy-1 tokens:", out[:, 1, prompt.shape[-1]:].tolist())


if __name__ == "__main__":
    main()
