# Citation: bigcode-project/transformers, commit 40db6c2f0 ("fix attention_mask", Raymond Li, 2023-11-11),
#   on the GQA branch that follows commit 13c6eb924 ("support gqa") of the StarCoder-2 prototype.
# Upstream: src/transformers/models/gpt_bigcode/modeling_gpt_bigcode.py,
#   GPTBigCodeModel.forward (builds `attention_mask = self_attention_mask.unsqueeze(2)`) and
#   GPTBigCodeAttention._attn (GQA path: scores shaped (batch, kv_heads, query, heads_per_group, key),
#   masked with torch.where(attention_mask, attn_weights, mask_value)).
# Bug: with head_groups (kv_heads) > 1 the model still hands the MQA-shaped mask (batch, query, 1, key)
#   to the 5-D GQA scores; broadcasting right-aligns it, so the mask's batch axis lands on the kv-group
#   axis. When batch == kv_heads nothing errors, but group g of every sample uses sample g's padding mask.
# Fix: for kv_heads > 1 the model adds `attention_mask = attention_mask.unsqueeze(1)`, giving
#   (batch, 1, query, 1, key).
import sys
import math
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class GPTBigCodeConfig:
    def __init__(self, **kw):
        self.vocab_size = 64
        self.n_embd = self.hidden_size = 32
        self.n_head = self.num_attention_heads = 4
        self.head_groups = 2
        self.n_layer = self.num_hidden_layers = 2
        self.n_inner = 64
        self.max_position_embeddings = 32
        self.use_position_embeddings = False
        self.use_rotary_embeddings = True
        self.rotary_embedding_scale = -math.log(10000.0)
        self.attention_window_size = None
        self.scale_attn_weights = True
        self.attention_softmax_in_fp32 = True
        self.scale_attention_softmax_in_fp32 = True
        self.layer_norm_epsilon = 1e-5
        self.attn_pdrop = self.resid_pdrop = self.embd_pdrop = 0.0
        self.__dict__.update(kw)


def upcast_masked_softmax(x, mask, mask_value, scale: float, softmax_dtype: torch.dtype):
    input_dtype = x.dtype
    x = x.to(softmax_dtype) * scale
    x = torch.where(mask, x, mask_value)
    x = torch.nn.functional.softmax(x, dim=-1).to(input_dtype)
    return x


def upcast_softmax(x, scale: float, softmax_dtype: torch.dtype):
    input_dtype = x.dtype
    x = x.to(softmax_dtype) * scale
    return torch.nn.functional.softmax(x, dim=-1).to(input_dtype)


def _apply_rotary_embeddings(tensor, rope_frequencies):
    complex_tensor = torch.view_as_complex(tensor.float().view(*tensor.shape[:-1], -1, rope_frequencies.size(-1), 2))
    return torch.view_as_real(complex_tensor * rope_frequencies).view_as(tensor).type_as(tensor)


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.mask_value = None
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.kv_heads = config.head_groups
        self.kv_dim = self.kv_heads * self.head_dim
        self.use_rotary_embeddings = config.use_rotary_embeddings
        self.scale_attn_weights = config.scale_attn_weights
        self.layer_idx = layer_idx
        self.attention_softmax_in_fp32 = config.attention_softmax_in_fp32
        self.scale_attention_softmax_in_fp32 = config.scale_attention_softmax_in_fp32 and config.attention_softmax_in_fp32
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _get_mask_value(self, device, dtype):
        if self.mask_value is None or self.mask_value.dtype != dtype or self.mask_value.device != device:
            self.mask_value = torch.full([], torch.finfo(dtype).min, dtype=dtype, device=device)
        return self.mask_value

    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        dtype = query.dtype
        softmax_dtype = torch.float32 if self.attention_softmax_in_fp32 else dtype
        upcast = dtype != softmax_dtype
        unscale = self.layer_idx + 1 if self.scale_attention_softmax_in_fp32 and upcast else 1
        scale_factor = unscale**-1
        if self.scale_attn_weights:
            scale_factor /= self.head_dim**0.5

        query_shape = query.shape
        batch_size = query_shape[0]
        query_length = query_shape[1]
        key_length = key.size(-1)
        if self.kv_heads == 1:
            attn_shape = (batch_size, query_length, self.num_heads, key_length)
            attn_view = (batch_size, query_length * self.num_heads, key_length)
            query = query.reshape(batch_size, query_length * self.num_heads, self.head_dim)
        else:
            heads_per_group = self.num_heads // self.kv_heads
            attn_shape = (batch_size, self.kv_heads, query_length, heads_per_group, key_length)
            attn_view = (batch_size * self.kv_heads, query_length * heads_per_group, key_length)
            query = query.reshape(batch_size, query_length, self.kv_heads, heads_per_group, self.head_dim).transpose(1, 2)
            query = query.reshape(batch_size * self.kv_heads, query_length * heads_per_group, self.head_dim)
            key = key.reshape(batch_size * self.kv_heads, self.head_dim, key_length)
            value = value.transpose(1, 2)
            value = value.reshape(batch_size * self.kv_heads, self.head_dim, key_length).transpose(1, 2)

        attn_weights = torch.zeros(attn_view, device=query.device, dtype=query.dtype)
        attn_weights = torch.baddbmm(attn_weights, query, key, beta=1, alpha=scale_factor).view(attn_shape)

        if upcast:
            if attention_mask is None:
                attn_weights = upcast_softmax(attn_weights, unscale, softmax_dtype)
            else:
                mask_value = self._get_mask_value(attn_weights.device, softmax_dtype)
                attn_weights = upcast_masked_softmax(attn_weights, attention_mask, mask_value, unscale, softmax_dtype)
        else:
            if attention_mask is not None:
                mask_value = self._get_mask_value(attn_weights.device, softmax_dtype)
                attn_weights = torch.where(attention_mask, attn_weights, mask_value)
            attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)

        attn_weights = self.attn_dropout(attn_weights)

        if self.kv_heads == 1:
            attn_output = torch.bmm(attn_weights.view(attn_view), value).view(query_shape)
        else:
            attn_output = torch.bmm(attn_weights.view(attn_view), value)
            attn_output = attn_output.reshape(batch_size, self.kv_heads, query_length, heads_per_group, self.head_dim).transpose(1, 2)
            attn_output = attn_output.reshape(batch_size, query_length, self.kv_heads * heads_per_group * self.head_dim)
        return attn_output, attn_weights

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False,
                rotary_embedding_frequencies_q=None, rotary_embedding_frequencies_k=None):
        query, key_value = self.c_attn(hidden_states).split((self.embed_dim, 2 * self.kv_dim), dim=2)
        if layer_past is not None:
            key_value = torch.cat((layer_past, key_value), dim=-2)
        present = key_value if use_cache else None
        key, value = key_value.split((self.kv_heads * self.head_dim), dim=-1)
        if self.use_rotary_embeddings:
            query = _apply_rotary_embeddings(query, rotary_embedding_frequencies_q)
            key = _apply_rotary_embeddings(key, rotary_embedding_frequencies_k)
        attn_output, attn_weights = self._attn(query, key.transpose(-1, -2), value, attention_mask)
        attn_output = self.resid_dropout(self.c_proj(attn_output))
        return attn_output, present


class GPTBigCodeMLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, intermediate_size)
        self.c_proj = nn.Linear(intermediate_size, config.hidden_size)
        self.act = nn.GELU(approximate="tanh")
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states):
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


class GPTBigCodeBlock(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPTBigCodeAttention(config, layer_idx=layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPTBigCodeMLP(config.n_inner, config)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False,
                rotary_embedding_frequencies_q=None, rotary_embedding_frequencies_k=None):
        residual = hidden_states
        attn_output, present = self.attn(
            self.ln_1(hidden_states), layer_past=layer_past, attention_mask=attention_mask, use_cache=use_cache,
            rotary_embedding_frequencies_q=rotary_embedding_frequencies_q,
            rotary_embedding_frequencies_k=rotary_embedding_frequencies_k,
        )
        hidden_states = attn_output + residual
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states))
        return hidden_states, present


class GPTBigCodeModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.kv_heads = config.head_groups
        self.embed_dim = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        if config.use_position_embeddings:
            self.wpe = nn.Embedding(config.max_position_embeddings, self.embed_dim)
        if config.use_rotary_embeddings:
            kv_channels = config.n_embd / config.n_head
            angles = torch.outer(
                torch.arange(config.max_position_embeddings, dtype=torch.float32),
                torch.exp(config.rotary_embedding_scale * torch.arange(0, 1, 2 / kv_channels, dtype=torch.float32)),
            )
            self._rotary_embedding_frequencies = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GPTBigCodeBlock(config, layer_idx=i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        max_positions = config.max_position_embeddings
        self.register_buffer("bias", torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)), persistent=False)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, position_ids=None, use_cache=False):
        input_shape = input_ids.size()
        batch_size = input_ids.shape[0]
        device = input_ids.device
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * len(self.h))
        else:
            past_length = past_key_values[0].size(-2)

        if attention_mask is not None and len(attention_mask.shape) == 2 and position_ids is None:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_length > 0:
                position_ids = position_ids[:, past_length: input_shape[-1] + past_length:]
        elif position_ids is None:
            position_ids = torch.arange(past_length, input_shape[-1] + past_length, dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0).view(-1, input_shape[-1])

        rotary_embedding_frequencies_q = None
        rotary_embedding_frequencies_k = None
        if self.config.use_rotary_embeddings:
            rotary_embedding_frequencies_q = self._rotary_embedding_frequencies[:, past_length: past_length + input_shape[-1]]
            rotary_embedding_frequencies_k = self._rotary_embedding_frequencies[:, :past_length + input_shape[-1], :, :]

        # Self-attention mask.
        query_length = input_shape[-1]
        key_length = past_length + query_length
        self_attention_mask = self.bias[None, key_length - query_length: key_length, :key_length]
        if self.config.attention_window_size is not None:
            self_attention_mask.triu_(-self.config.attention_window_size + 1)
        if attention_mask is not None:
            self_attention_mask = self_attention_mask * attention_mask.view(batch_size, 1, -1).to(
                dtype=torch.bool, device=self_attention_mask.device
            )
        # Attention-shape: (batch_size, query_length, n_heads, key_length)
        attention_mask = self_attention_mask.unsqueeze(2)
        if FIXED and self.kv_heads > 1:
            # (batch_size, self.kv_heads, query_length, heads_per_group, key_length)
            attention_mask = attention_mask.unsqueeze(1)

        hidden_states = self.wte(input_ids)
        if self.config.use_position_embeddings:
            hidden_states = hidden_states + self.wpe(position_ids)
        hidden_states = self.drop(hidden_states)

        presents = [] if use_cache else None
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(
                hidden_states, layer_past=layer_past, attention_mask=attention_mask, use_cache=use_cache,
                rotary_embedding_frequencies_q=rotary_embedding_frequencies_q,
                rotary_embedding_frequencies_k=rotary_embedding_frequencies_k,
            )
            if use_cache:
                presents.append(present)
        return self.ln_f(hidden_states), presents


class GPTBigCodeForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = GPTBigCodeModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden_states, _ = self.transformer(input_ids, attention_mask=attention_mask)
        lm_logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            shift_logits = lm_logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = nn.CrossEntropyLoss()(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return loss, lm_logits


def main():
    torch.manual_seed(0)
    config = GPTBigCodeConfig()
    model = GPTBigCodeForCausalLM(config).eval()
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.3)

    pad = 0
    # Two code prompts of different lengths, left-padded for batched completion.
    prompts = [[5, 17, 9, 33, 12, 40, 7, 21, 3], [11, 25, 8, 30]]
    max_len = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (max_len - len(p)) + p for p in prompts])
    attention_mask = (input_ids != pad).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    with torch.no_grad():
        loss, logits = model(input_ids, attention_mask=attention_mask, labels=labels)
        next_tokens = logits[:, -1].argmax(-1)
    print("input_ids:", input_ids.tolist())
    print("loss: %.6f" % loss.item())
    print("next-token logits row0:", [round(v, 4) for v in logits[0, -1, :5].tolist()])
    print("next-token logits row1:", [round(v, 4) for v in logits[1, -1, :5].tolist()])
    print("greedy next tokens:", next_tokens.tolist())


if __name__ == "__main__":
    main()
