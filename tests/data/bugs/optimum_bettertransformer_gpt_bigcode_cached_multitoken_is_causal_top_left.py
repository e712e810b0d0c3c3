# huggingface/optimum -- PR huggingface/optimum#1416 (commit c8cf353): BetterTransformer gpt_bigcode (StarCoder/SantaCoder)
# wrapped SDPA used is_causal=True whenever batch_size == 1 and query_length > 1, also when new tokens follow a KV cache,
# so SDPA's top-left causal mask hides most of the cached prefix from the new tokens.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

EMBED, HEADS, LAYERS, VOCAB, NPOS = 64, 4, 2, 50, 32


class GPTBigCodeAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_dim = EMBED
        self.num_heads = HEADS
        self.head_dim = EMBED // HEADS
        self.kv_dim = self.head_dim  # multi_query
        self.multi_query = True
        self.scale_attn_weights = True
        self.training = False
        self.c_attn = nn.Linear(EMBED, EMBED + 2 * self.kv_dim)
        self.c_proj = nn.Linear(EMBED, EMBED)
        self.attn_pdrop = 0.0
        self.mask_value = None

    def _get_mask_value(self, device, dtype):
        if self.mask_value is None or self.mask_value.dtype != dtype or self.mask_value.device != device:
            self.mask_value = torch.full([], torch.finfo(dtype).min, dtype=dtype, device=device)
        return self.mask_value

    # optimum/bettertransformer/models/attention.py
    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        query_shape = query.shape
        batch_size = query_shape[0]
        kv_seq_len = key.shape[-2]
        query_length = query_shape[1]
        query = query.view(batch_size, query_length, self.num_heads, self.head_dim).transpose(1, 2)
        key = key.unsqueeze(1)
        value = value.unsqueeze(1)
        dropout_p = self.attn_pdrop if self.training else 0.0
        key = key.expand(-1, self.num_heads, -1, -1)
        value = value.expand(-1, self.num_heads, -1, -1)

        if not FIXED:
            if batch_size == 1 or self.training:
                if query_length > 1:
                    sdpa_result = F.scaled_dot_product_attention(
                        query, key, value, attn_mask=None, dropout_p=dropout_p, is_causal=True
                    )
                else:
                    sdpa_result = F.scaled_dot_product_attention(
                        query, key, value, attn_mask=None, dropout_p=dropout_p, is_causal=False
                    )
            else:
                if attention_mask is not None:
                    mask_value = self._get_mask_value(query.device, query.dtype)
                    attention_mask = attention_mask.transpose(1, 2)
                    attention_mask = torch.where(attention_mask, 0.0, mask_value)
                sdpa_result = F.scaled_dot_product_attention(
                    query, key, value, attn_mask=attention_mask, dropout_p=dropout_p, is_causal=False
                )
        else:
            if self.training:
                is_causal = True
                attn_mask = None
            elif batch_size == 1 and query_length == 1:
                is_causal = False
                attn_mask = None
            elif batch_size == 1 and kv_seq_len == query_length:
                is_causal = True
                attn_mask = None
            elif attention_mask is not None:
                mask_value = self._get_mask_value(query.device, query.dtype)
                attention_mask = attention_mask.transpose(1, 2)
                attn_mask = torch.where(attention_mask, 0.0, mask_value)
                is_causal = False
            else:
                attn_mask = None
                is_causal = True
            sdpa_result = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
            )

        sdpa_result = sdpa_result.transpose(1, 2).reshape(query_shape)
        return sdpa_result

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        query, key_value = self.c_attn(hidden_states).split((self.embed_dim, 2 * self.kv_dim), dim=2)
        if layer_past is not None:
            key_value = torch.cat((layer_past, key_value), dim=-2)
        present = key_value if use_cache else None
        key, value = key_value.split((self.head_dim, self.head_dim), dim=-1)
        attn_output = self._attn(query, key, value, attention_mask)
        return self.c_proj(attn_output), present


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBED)
        self.attn = GPTBigCodeAttention()
        self.ln_2 = nn.LayerNorm(EMBED)
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(approximate="tanh"), nn.Linear(4 * EMBED, EMBED))

    def forward(self, h, layer_past, attention_mask):
        a, present = self.attn(self.ln_1(h), layer_past, attention_mask, use_cache=True)
        h = h + a
        return h + self.mlp(self.ln_2(h)), present


class GPTBigCodeForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, EMBED)
        self.wpe = nn.Embedding(NPOS, EMBED)
        self.h = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(EMBED)
        self.lm_head = nn.Linear(EMBED, VOCAB, bias=False)
        self.multi_query = True
        self.register_buffer("bias", torch.tril(torch.ones((NPOS, NPOS), dtype=torch.bool)), persistent=False)

    def forward(self, input_ids, past_key_values=None):
        batch_size, query_length = input_ids.shape
        past_length = 0 if past_key_values is None else past_key_values[0].size(-2)
        key_length = past_length + query_length
        # transformers GPTBigCodeModel: self_attention_mask [batch, tgt, 1, src]
        self_attention_mask = self.bias[None, key_length - query_length: key_length, :key_length]
        attention_mask = self_attention_mask.unsqueeze(2 if self.multi_query else 1)
        position_ids = torch.arange(past_length, key_length).unsqueeze(0)
        h = self.wte(input_ids) + self.wpe(position_ids)
        presents = []
        for i, block in enumerate(self.h):
            h, p = block(h, None if past_key_values is None else past_key_values[i], attention_mask)
            presents.append(p)
        return self.lm_head(self.ln_f(h)), presents


model = GPTBigCodeForCausalLM().eval()
ids = torch.randint(0, VOCAB, (1, 12))
with torch.no_grad():
    full_logits, _ = model(ids)
    # "def quick_sort" prefix, then "(arr" = several new tokens on top of the KV cache
    _, past = model(ids[:, :8])
    new_logits, _ = model(ids[:, 8:], past_key_values=past)
diff = (new_logits - full_logits[:, 8:]).abs().max().item()
print(f"max |cached multi-token logits - full-sequence logits| = {diff:.6f}")
