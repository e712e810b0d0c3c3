"""ChatGLM2-6B P-tuning v2, shrunk: learned prefix key/values (pre_seq_len) in every layer,
a left-padded batch, greedy decode through the tuple key/value cache.

Ported from THUDM/chatglm2-6b modeling_chatglm.py (Hugging Face Hub model repository; the copy read is
bq-xiao/chatglm2-6b-model @1fd8e8df43bf1f309dff8edf3e7a71b5c5608c64 modeling_chatglm.py):
PrefixEncoder, RotaryEmbedding / apply_rotary_pos_emb, CoreAttention (torch>=2 SDPA branch),
SelfAttention (multi-query groups, kv_cache cat on dim 0), ChatGLMPreTrainedModel.get_masks,
ChatGLMModel.get_prompt / forward, ChatGLMForConditionalGeneration prepare_inputs_for_generation /
_update_model_kwargs_for_generation.  The left padding and its position ids follow ChatGLM2's tokenizer
(`_pad`: padding_side left, position_ids padded with 0 on the left).  P-tuning v2 is
THUDM/ChatGLM2-6B ptuning/ (config.pre_seq_len, prefix_projection=False).

Checked against every prompt run alone, unpadded, through a reference that loops over query positions
and attends to [all prefix keys] + [the prompt's own keys up to the query] by hand.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class ChatGLMConfig:
    def __init__(self, pre_seq_len=None):
        self.num_layers = 2
        self.padded_vocab_size = 40
        self.hidden_size = 32
        self.ffn_hidden_size = 48
        self.kv_channels = 8
        self.num_attention_heads = 4
        self.seq_length = 64
        self.layernorm_epsilon = 1e-5
        self.multi_query_attention = True
        self.multi_query_group_num = 2
        self.add_bias_linear = False
        self.add_qkv_bias = True
        self.post_layer_norm = True
        self.apply_residual_connection_post_layernorm = False
        self.pre_seq_len = pre_seq_len
        self.prefix_projection = False
        self.use_cache = True


class PrefixEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.prefix_projection = config.prefix_projection
        self.embedding = nn.Embedding(
            config.pre_seq_len, config.num_layers * config.kv_channels * config.multi_query_group_num * 2)

    def forward(self, prefix):
        return self.embedding(prefix)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, dtype=torch.float32):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).to(dtype=dtype) / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.dim = dim

    def forward_impl(self, seq_len, n_elem, dtype, device, base=10000):
        theta = 1.0 / (base ** (torch.arange(0, n_elem, 2, dtype=dtype, device=device) / n_elem))
        seq_idx = torch.arange(seq_len, dtype=dtype, device=device)
        idx_theta = torch.outer(seq_idx, theta).float()
        return torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)

    def forward(self, max_seq_len):
        return self.forward_impl(max_seq_len, self.dim, dtype=self.inv_freq.dtype, device=self.inv_freq.device)


def apply_rotary_pos_emb(x, rope_cache):
    # x: [sq, b, np, hn]
    sq, np_, hn = x.size(0), x.size(2), x.size(3)
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    rope_cache = rope_cache[:sq]
    xshaped = x.reshape(sq, -1, np_, rot_dim // 2, 2)
    rope_cache = rope_cache.view(sq, -1, 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ],
        -1,
    )
    return torch.cat((x_out2.flatten(3), x_pass), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n) + 0.1 * torch.randn(n))
        self.eps = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.eps))


class CoreAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size_per_partition = config.kv_channels * config.num_attention_heads

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        # torch >= 2 branch of the original
        query_layer, key_layer, value_layer = [k.permute(1, 2, 0, 3) for k in [query_layer, key_layer, value_layer]]
        if attention_mask is None and query_layer.shape[2] == key_layer.shape[2]:
            context_layer = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, is_causal=True)
        else:
            if attention_mask is not None:
                attention_mask = ~attention_mask  # get_masks marks True = masked out; SDPA wants True = keep
            context_layer = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, attention_mask)
        context_layer = context_layer.permute(2, 0, 1, 3)
        return context_layer.reshape(*context_layer.size()[:-2], self.hidden_size_per_partition)


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hn = config.kv_channels
        self.np = config.num_attention_heads
        self.ng = config.multi_query_group_num
        self.query_key_value = nn.Linear(config.hidden_size, self.np * self.hn + 2 * self.hn * self.ng, bias=True)
        self.core_attention = CoreAttention(config)
        self.dense = nn.Linear(self.np * self.hn, config.hidden_size, bias=False)

    def qkv(self, hidden_states, rotary_pos_emb):
        mixed = self.query_key_value(hidden_states)
        q, k, v = mixed.split([self.np * self.hn, self.ng * self.hn, self.ng * self.hn], dim=-1)
        q = q.view(q.size()[:-1] + (self.np, self.hn))
        k = k.view(k.size()[:-1] + (self.ng, self.hn))
        v = v.view(v.size()[:-1] + (self.ng, self.hn))
        if rotary_pos_emb is not None:
            q = apply_rotary_pos_emb(q, rotary_pos_emb)
            k = apply_rotary_pos_emb(k, rotary_pos_emb)
        return q, k, v

    def expand_groups(self, t):
        t = t.unsqueeze(-2).expand(-1, -1, -1, self.np // self.ng, -1)
        return t.contiguous().view(t.size()[:2] + (self.np, self.hn))

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        query_layer, key_layer, value_layer = self.qkv(hidden_states, rotary_pos_emb)
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            key_layer = torch.cat((cache_k, key_layer), dim=0)
            value_layer = torch.cat((cache_v, value_layer), dim=0)
        kv_cache = (key_layer, value_layer) if use_cache else None
        key_layer = self.expand_groups(key_layer)
        value_layer = self.expand_groups(value_layer)
        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)
        return self.dense(context_layer), kv_cache


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size * 2, bias=False)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        a, b = torch.chunk(self.dense_h_to_4h(x), 2, dim=-1)
        return self.dense_4h_to_h(F.silu(a) * b)


class GLMBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.self_attention = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        ln = self.input_layernorm(hidden_states)
        attn, kv_cache = self.self_attention(ln, attention_mask, rotary_pos_emb, kv_cache=kv_cache, use_cache=use_cache)
        ln_in = hidden_states + attn
        out = ln_in + self.mlp(self.post_attention_layernorm(ln_in))
        return out, kv_cache


class ChatGLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.num_layers = config.num_layers
        self.multi_query_group_num = config.multi_query_group_num
        self.kv_channels = config.kv_channels
        self.seq_length = config.seq_length
        self.rotary_pos_emb = RotaryEmbedding(config.kv_channels // 2)
        self.layers = nn.ModuleList([GLMBlock(config) for _ in range(config.num_layers)])
        self.final_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.pre_seq_len = config.pre_seq_len
        if self.pre_seq_len is not None:
            self.prefix_tokens = torch.arange(self.pre_seq_len).long()
            self.prefix_encoder = PrefixEncoder(config)
            self.dropout = nn.Dropout(0.1)

    def get_masks(self, input_ids, past_key_values, padding_mask=None):
        batch_size, seq_length = input_ids.shape
        full_attention_mask = torch.ones(batch_size, seq_length, seq_length, device=input_ids.device)
        full_attention_mask.tril_()
        past_length = 0
        if past_key_values:
            past_length = past_key_values[0][0].shape[0]
        if past_length:
            full_attention_mask = torch.cat((torch.ones(batch_size, seq_length, past_length,
                                                        device=input_ids.device), full_attention_mask), dim=-1)
        if padding_mask is not None:
            full_attention_mask = full_attention_mask * padding_mask.unsqueeze(1)
        if not past_length and padding_mask is not None:
            # left-pad query rows would be fully masked: open them up (their outputs are never read)
            full_attention_mask -= padding_mask.unsqueeze(-1) - 1
        full_attention_mask = (full_attention_mask < 0.5).bool()
        full_attention_mask.unsqueeze_(1)
        return full_attention_mask

    def get_prompt(self, batch_size, device, dtype=torch.half):
        prefix_tokens = self.prefix_tokens.unsqueeze(0).expand(batch_size, -1).to(device)
        past_key_values = self.prefix_encoder(prefix_tokens).type(dtype)
        past_key_values = past_key_values.view(
            batch_size, self.pre_seq_len, self.num_layers * 2, self.multi_query_group_num, self.kv_channels)
        past_key_values = self.dropout(past_key_values)
        past_key_values = past_key_values.permute([2, 1, 0, 3, 4]).split(2)
        return past_key_values

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None,
                use_cache=True, return_last_logit=False):
        batch_size, seq_length = input_ids.shape
        inputs_embeds = self.word_embeddings(input_ids).transpose(0, 1).contiguous()

        if self.pre_seq_len is not None:
            if past_key_values is None:
                past_key_values = self.get_prompt(batch_size=batch_size, device=input_ids.device,
                                                  dtype=inputs_embeds.dtype)
            if attention_mask is not None:
                attention_mask = torch.cat([attention_mask.new_ones((batch_size, self.pre_seq_len)),
                                            attention_mask], dim=-1)

        full_attention_mask = None
        if (attention_mask is not None and not attention_mask.all()) or (past_key_values and seq_length != 1):
            full_attention_mask = self.get_masks(input_ids, past_key_values, padding_mask=attention_mask)

        rotary_pos_emb = self.rotary_pos_emb(self.seq_length)
        if position_ids is not None:
            rotary_pos_emb = rotary_pos_emb[position_ids]
        else:
            rotary_pos_emb = rotary_pos_emb[None, :seq_length]
        rotary_pos_emb = rotary_pos_emb.transpose(0, 1).contiguous()

        kv_caches = past_key_values if past_key_values else [None] * self.num_layers
        hidden_states = inputs_embeds
        presents = ()
        for index, layer in enumerate(self.layers):
            hidden_states, kv_cache = layer(hidden_states, full_attention_mask, rotary_pos_emb,
                                            kv_cache=kv_caches[index], use_cache=use_cache)
            presents = presents + (kv_cache,)
        hidden_states = self.final_layernorm(hidden_states)
        if return_last_logit:
            hidden_states = hidden_states[-1:]
        lm_logits = self.output_layer(hidden_states).transpose(0, 1).contiguous()
        return lm_logits, presents


def tokenizer_pad_left(prompts, pad_id=0):
    """ChatGLM2 tokenizer `_pad` with padding_side="left"."""
    L = max(len(p) for p in prompts)
    ids, mask, pos = [], [], []
    for p in prompts:
        d = L - len(p)
        ids.append([pad_id] * d + p)
        mask.append([0] * d + [1] * len(p))
        pos.append([0] * d + list(range(len(p))))
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(pos)


@torch.no_grad()
def generate(model, prompts, max_new_tokens):
    input_ids, attention_mask, position_ids = tokenizer_pad_left(prompts)
    past_key_values = None
    is_first_forward = True
    all_logits = []
    for _ in range(max_new_tokens):
        # prepare_inputs_for_generation
        if not is_first_forward and past_key_values is not None:
            step_ids, step_pos = input_ids[:, -1:], position_ids[..., -1:]
        else:
            step_ids, step_pos = input_ids, position_ids
        logits, presents = model(step_ids, position_ids=step_pos, attention_mask=attention_mask,
                                 past_key_values=past_key_values, return_last_logit=True)
        next_logits = logits[:, -1, :]
        all_logits.append(next_logits)
        next_tokens = next_logits.argmax(-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        # _update_model_kwargs_for_generation
        past_key_values = presents
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        new_position_id = position_ids[..., -1:].clone() + 1
        position_ids = torch.cat([position_ids, new_position_id], dim=-1)
        is_first_forward = False
    return input_ids, torch.stack(all_logits, 1)


@torch.no_grad()
def reference_logits(model, ids):
    """One unpadded sequence, no cache; each query i attends by hand to prefix keys + keys 0..i."""
    S = len(ids)
    x = model.word_embeddings(torch.tensor(ids))  # [S, h]
    rope = model.rotary_pos_emb(model.seq_length)[torch.arange(S)][:, None]  # [S, 1, rot/2, 2]
    prefix = None
    if model.pre_seq_len is not None:
        prefix = model.prefix_encoder.embedding.weight.view(
            model.pre_seq_len, model.num_layers * 2, model.multi_query_group_num, model.kv_channels)
    for li, layer in enumerate(model.layers):
        att = layer.self_attention
        ln = layer.input_layernorm(x)
        q, k, v = att.qkv(ln[:, None], rope)
        q, k, v = q[:, 0], k[:, 0], v[:, 0]  # [S, heads or groups, hn]
        if prefix is not None:
            k = torch.cat([prefix[:, 2 * li], k], 0)
            v = torch.cat([prefix[:, 2 * li + 1], v], 0)
        P = 0 if prefix is None else model.pre_seq_len
        rep = att.np // att.ng
        out = torch.zeros(S, att.np, att.hn)
        for i in range(S):
            for h in range(att.np):
                g = h // rep
                keys = k[: P + i + 1, g]
                vals = v[: P + i + 1, g]
                s = keys @ q[i, h] / math.sqrt(att.hn)
                p = torch.exp(s - s.max())
                out[i, h] = (p / p.sum()) @ vals
        x = x + att.dense(out.reshape(S, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.output_layer(model.final_layernorm(x))


@torch.no_grad()
def reference_generate(model, prompt, max_new_tokens):
    ids = list(prompt)
    step_logits = []
    for _ in range(max_new_tokens):
        lg = reference_logits(model, ids)[-1]
        step_logits.append(lg)
        ids.append(int(lg.argmax()))
    return ids, torch.stack(step_logits)


def main():
    prompts = [[5, 9, 3, 17, 22, 8, 11], [7, 2, 30], [12, 4, 19, 6, 25]]
    new = 4
    ok = True
    for pre_seq_len in (3, None):  # P-tuning v2 prefix, then the base model (pad rows opened by get_masks)
        torch.manual_seed(1)
        model = ChatGLMModel(ChatGLMConfig(pre_seq_len=pre_seq_len)).eval()
        tokens, logits = generate(model, prompts, new)
        L = max(len(p) for p in prompts)
        for b, p in enumerate(prompts):
            ref_ids, ref_logits = reference_generate(model, p, new)
            same_tokens = tokens[b, L:].tolist() == ref_ids[len(p):]
            same_logits = torch.allclose(logits[b], ref_logits, atol=1e-4, rtol=1e-4)
            ok &= same_tokens and same_logits
            print(f"pre_seq_len={pre_seq_len} row {b}: tokens match={same_tokens} logits match={same_logits}")
        # full prefill logits at every real position (training-style forward)
        ids, mask, pos = tokenizer_pad_left(prompts)
        full, _ = model(ids, position_ids=pos, attention_mask=mask, use_cache=False)
        for b, p in enumerate(prompts):
            ref = reference_logits(model, p)
            m = torch.allclose(full[b, L - len(p):], ref, atol=1e-4, rtol=1e-4)
            ok &= m
            print(f"pre_seq_len={pre_seq_len} row {b}: prefill logits match={m}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
