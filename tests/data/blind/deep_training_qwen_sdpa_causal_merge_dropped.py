# ssbuild/deep_training commit bbae5a5 ("fix qwen attention_mask", PR #97): QWenAttention's SDPA path called
# attention_mask.masked_fill(~causal_mask, min) without keeping the result, so padded batches ran non-causal.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
SUPPORT_TORCH2 = True


class QWenConfig:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    layer_norm_epsilon = 1e-6


class QWenAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.use_cache_quantization = False

    def _split_heads(self, tensor):
        return tensor.view(tensor.size()[:-1] + (self.num_heads, self.head_dim))

    def _merge_heads(self, tensor):
        return tensor.contiguous().view(tensor.size()[:-2] + (self.num_heads * self.head_dim,))

    def forward(self, hidden_states, attention_mask=None):
        mixed_x_layer = self.c_attn(hidden_states)
        query, key, value = mixed_x_layer.split(self.num_heads * self.head_dim, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)

        key_size = key.size(1)
        if query.size(1) == key_size:
            causal_mask = torch.tril(
                torch.ones((key_size, key_size), dtype=torch.bool, device=query.device)
            ).view(1, 1, key_size, key_size)
        else:
            causal_mask = None
        query, key, value = query.permute(0, 2, 1, 3), key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)

        if not self.use_cache_quantization and SUPPORT_TORCH2:
            if attention_mask is not None:
                attention_mask = attention_mask.expand(-1, -1, causal_mask.size(2), -1)
                if causal_mask is not None:
                    if FIXED:
                        attention_mask = attention_mask.masked_fill(~causal_mask, torch.finfo(attention_mask.dtype).min)
                    else:
                        attention_mask.masked_fill(~causal_mask, torch.finfo(attention_mask.dtype).min)
            else:
                attention_mask = causal_mask
            attn_output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask).transpose(1, 2)
        return self.c_proj(self._merge_heads(attn_output))


class QWenBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = QWenAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 2 * config.hidden_size), nn.SiLU(),
                                 nn.Linear(2 * config.hidden_size, config.hidden_size))

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), attention_mask=attention_mask)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class QWenLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList([QWenBlock(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.wte(input_ids)
        if attention_mask is not None:
            batch_size = input_ids.shape[0]
            attention_mask = attention_mask.view(batch_size, -1)[:, None, None, :]
            attention_mask = attention_mask.to(dtype=hidden_states.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(hidden_states.dtype).min
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask=attention_mask)
        return self.lm_head(self.ln_f(hidden_states))


config = QWenConfig()
model = QWenLMHeadModel(config)
input_ids = torch.randint(1, config.vocab_size, (2, 8))
attention_mask = torch.ones(2, 8, dtype=torch.long)
attention_mask[1, 6:] = 0  # right-padded second sample
labels = input_ids.clone()

logits = model(input_ids, attention_mask=attention_mask)  # training forward on a padded batch
loss = F.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), labels[:, 1:].reshape(-1))
with torch.no_grad():
    changed = input_ids.clone()
    changed[0, 5] = (changed[0, 5] + 1) % config.vocab_size  # change a later token of sample 0
    logits2 = model(changed, attention_mask=attention_mask)
print("fixed" if FIXED else "buggy", f"loss {loss.item():.4f}",
      "| logits at positions 0..4 move when token 5 changes:", f"{(logits[0, :5] - logits2[0, :5]).abs().max().item():.4f}")
