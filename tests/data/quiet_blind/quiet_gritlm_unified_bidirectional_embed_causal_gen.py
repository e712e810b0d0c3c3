# Citation: ContextualAI/gritlm scripts/modeling_mistral_gritlm.py (MistralModel.forward: is_causal switches between
#   _prepare_4d_causal_attention_mask(..., sliding_window) and _prepare_4d_attention_mask), commit
#   a09a2c858dfaf4c428a3bb776e244ac1da98c3f0, and gritlm/gritlm.py (GritLM.encode with attn="bbcc", padding_side="right",
#   instruction tokens zeroed in attention_mask before mean pooling), commit 134d8b4a023db904d7c7c1e207f647c8914b685a.
# One model, two masks: embedding passes is_causal=False -> additive float mask that only blocks right-padding keys
# (bidirectional over the real tokens); generation/LM loss uses the causal + padding mask. Pad query rows still see
# real keys; pooling divides by the (instruction-free) attention_mask sum, and the LM loss ignores pads (-100).
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class MistralConfig:
    vocab_size = 120
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    sliding_window = 4096
    pad_token_id = 0


# transformers.modeling_attn_mask_utils (the version GritLM's modeling file imports)
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0, sliding_window: Optional[int] = None):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    if sliding_window is not None:
        diagonal = past_key_values_length - sliding_window + 1
        context_mask = 1 - torch.triu(torch.ones_like(mask, dtype=torch.int), diagonal=diagonal)
        mask.masked_fill_(context_mask.bool(), torch.finfo(dtype).min)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length,
                                      sliding_window=None):
    causal_4d_mask = _make_causal_mask(input_shape, inputs_embeds.dtype, inputs_embeds.device,
                                       past_key_values_length, sliding_window)
    expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1])
    return causal_4d_mask.masked_fill(expanded_attn_mask.bool(), torch.finfo(inputs_embeds.dtype).min)


def _prepare_4d_attention_mask(mask, dtype, tgt_len=None):
    return _expand_mask(mask=mask, dtype=dtype, tgt_len=tgt_len)


class MistralRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class MistralAttention(nn.Module):  # eager
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return self.o_proj(attn_output)


class MistralDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = MistralAttention(config)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_layernorm = MistralRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MistralRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, position_ids):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask, position_ids)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MistralModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([MistralDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = MistralRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, attention_mask=None, is_causal: Optional[bool] = True):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = 0
        position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length).unsqueeze(0)
        inputs_embeds = self.embed_tokens(input_ids)
        # 4d mask is passed through the layers (eager path)
        if is_causal:
            attention_mask = _prepare_4d_causal_attention_mask(attention_mask, (batch_size, seq_length), inputs_embeds,
                                                               past_key_values_length,
                                                               sliding_window=self.config.sliding_window)
        else:
            # Shape: batch_size, 1, query_length, key_value_length
            attention_mask = _prepare_4d_attention_mask(attention_mask, inputs_embeds.dtype)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask, position_ids)
        return (self.norm(hidden_states),)


class MistralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = MistralModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, labels):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask)[0]
        logits = self.lm_head(hidden_states).float()
        shift_logits = logits[..., :-1, :].contiguous().view(-1, self.config.vocab_size)
        shift_labels = labels[..., 1:].contiguous().view(-1)
        loss = F.cross_entropy(shift_logits, shift_labels, reduction="sum") / attention_mask.sum()
        return loss, logits


def pooling(hidden_state, attention_mask, pooling_method="mean"):
    s = torch.sum(hidden_state * attention_mask.unsqueeze(-1).float(), dim=1)
    d = attention_mask.sum(dim=1, keepdim=True).float()
    return s / d


def tokenize_right(seqs):  # padding_side="right"
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    am = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        am[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": am}


config = MistralConfig()
lm = MistralForCausalLM(config)
instruction = [1, 7, 8, 9]  # "<s><|user|>\n{instr}\n<|embed|>\n"
texts = [[int(t) for t in torch.randint(10, 120, (n,))] for n in (9, 3, 6)]

# GritLM.encode with attn='bbcc': bidirectional for embeddings
lm.eval()
with torch.no_grad():
    inputs = tokenize_right([instruction + t for t in texts])
    inputs["is_causal"] = False
    last_hidden_state = lm.model(**inputs)[0]
    inputs["attention_mask"][:, :len(instruction)] = 0  # remove instruction tokens from the mean
    emb = F.normalize(pooling(last_hidden_state, inputs["attention_mask"]), dim=-1)

# generative step: causal LM loss on a right-padded batch
lm.train()
gen = tokenize_right([instruction + t + [2] for t in texts])
labels = gen["input_ids"].masked_fill(gen["attention_mask"] == 0, -100)
opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
loss, _ = lm(gen["input_ids"], gen["attention_mask"], labels)
loss.backward()
opt.step()
print(f"emb_sim01={(emb[0] @ emb[1]).item():.4f} lm_loss={loss.item():.4f}")
