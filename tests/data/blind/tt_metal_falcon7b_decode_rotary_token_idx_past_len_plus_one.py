"""tt-metal Falcon-7B demo: decode rotated the new token's query and key one position too far.

Citation: tenstorrent/tt-metal#5254 (fixes tenstorrent/tt-metal#5253, "Fix layer_past_len value being
passed to rotary embedding in falcon models"); pre-fix file read at commit 00c49d5a
(models/demos/falcon7b/tt/falcon_attention.py; mask built in falcon_model.py model_preprocessing).

The bug: in decode mode TtFalconAttention.forward called
``self.rotary_embedding(query_layer, layer_past_len + 1)`` and the same for key_layer, so the token
written to the KV cache at slot ``layer_past_len`` (update_cache(..., layer_past_len)) was rotated as
if it stood at ``layer_past_len + 1``. The prefill path rotated positions 0..seq_len-1, so every
decode step sees its cached keys one position further away than they are.

The fix: pass ``layer_past_len`` as the token index of the rotary embedding.

Ported to torch (tt_lib ops written as plain tensor code with the same layouts: prefill
[batch=1, 1, seq, hidden] with fill_cache per user_id, decode [1, 1, batch=32, hidden] with
update_cache at layer_past_len and keys sliced to nearest_32(layer_past_len + 1), the -1e3 padded
attention mask of model_preprocessing), tiny Falcon config with random weights.
"""

import math
import sys
from typing import Optional, Tuple

import torch
from torch import nn
from transformers import FalconConfig, FalconForCausalLM

FIXED = "--fixed" in sys.argv


def nearest_32(x):
    return math.ceil(x / 32) * 32


# --- stand-ins for the tt_lib ops the project calls ---------------------------------------------

def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def tt_rotary_embedding(layer, cos_cached, sin_cached, token_idx=None):
    # tt_lib.tensor.rotary_embedding: without token_idx rows along dim -2 take positions 0..seq_len-1;
    # with token_idx (decode, rows are users) every row takes position token_idx.
    seq_len = layer.shape[-2]
    if token_idx is None:
        cos = cos_cached[:, :, :seq_len, :]
        sin = sin_cached[:, :, :seq_len, :]
    else:
        cos = cos_cached[:, :, token_idx : token_idx + 1, :]
        sin = sin_cached[:, :, token_idx : token_idx + 1, :]
    return layer * cos + rotate_half(layer) * sin


def fill_cache(cache, x, user_id):
    cache[user_id : user_id + 1, :, : x.shape[-2], :] = x


def update_cache(cache, x, update_idx):
    # x: [1, 1, batch, head_dim]
    cache[:, 0, update_idx, :] = x[0, 0]


def nlp_create_qkv_heads(fused, num_heads, head_dim):
    # fused: [d0, 1, rows, (num_heads + 2) * head_dim] -> q [d0, num_heads, rows, hd], k/v [d0, 1, rows, hd]
    d0, _, rows, _ = fused.shape
    x = fused.view(d0, rows, num_heads + 2, head_dim).permute(0, 2, 1, 3)
    return x[:, :num_heads], x[:, num_heads : num_heads + 1], x[:, num_heads + 1 :]


def nlp_concat_heads(x):
    d0, h, rows, hd = x.shape
    return x.permute(0, 2, 1, 3).reshape(d0, 1, rows, h * hd)


# --- model -----------------------------------------------------------------------------------------

class TtFalconRotaryEmbedding(torch.nn.Module):
    """See FalconRotaryEmbedding from hf_modeling_falcon.py"""

    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.max_seq_len_cached = max_position_embeddings
        t = torch.arange(self.max_seq_len_cached, device=inv_freq.device, dtype=inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.tt_cos_cached = emb.cos()[None, None, :, :]
        self.tt_sin_cached = emb.sin()[None, None, :, :]

    def forward(self, layer, token_idx: Optional[int] = None):
        seq_len = layer.shape[2]
        assert seq_len <= self.max_seq_len_cached, "seq_len exceeds max_seq_len_cached in RotaryEmbedding!"
        return tt_rotary_embedding(layer, self.tt_cos_cached, self.tt_sin_cached, token_idx)


class TtFalconAttention(nn.Module):
    def __init__(self, state_dict, base_url, layer_num, hidden_size, num_heads, max_position_embeddings=2048):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.max_position_embeddings = max_position_embeddings
        self.temperature = 0.92
        layer_name = f"{base_url}.{layer_num}.self_attention"
        self.query_key_value_weights = state_dict[f"{layer_name}.query_key_value.weight"].t()
        self.dense_weights = state_dict[f"{layer_name}.dense.weight"].t()
        self.rotary_embedding = TtFalconRotaryEmbedding(self.head_dim, max_position_embeddings=max_position_embeddings)
        self.scalar = 1 / math.sqrt(self.head_dim)

    def forward(self, hidden_states, attention_mask, llm_mode, user_id=0, layer_past=None, layer_past_len=0):
        """
        Prefill input shape: [batch, 1, seq_len, hidden_size]
        Decode input shape: [seq_len, 1, batch, hidden_size]
        """
        if llm_mode == "prefill":
            batch = hidden_states.shape[0]
            assert layer_past is not None
        elif llm_mode == "decode":
            batch = hidden_states.shape[2]
            assert layer_past is not None
            assert layer_past_len > 0 and layer_past_len <= self.max_position_embeddings
        else:
            raise NotImplementedError(llm_mode)

        fused_query_key_value = hidden_states @ self.query_key_value_weights
        query_layer, key_layer, value_layer = nlp_create_qkv_heads(fused_query_key_value, self.num_heads, self.head_dim)

        #########################
        ### ROTARY EMBEDDINGS ###
        #########################
        if llm_mode == "prefill":
            query_layer = self.rotary_embedding(query_layer)
            key_layer = self.rotary_embedding(key_layer)
        elif llm_mode == "decode":
            token_idx = layer_past_len if FIXED else layer_past_len + 1
            query_layer = self.rotary_embedding(query_layer, token_idx)
            key_layer = self.rotary_embedding(key_layer, token_idx)

        ######################
        ### K CACHE UPDATE ###
        ######################
        if llm_mode == "prefill":
            fill_cache(layer_past[0], key_layer, user_id)
        elif llm_mode == "decode":
            update_cache(layer_past[0], key_layer, layer_past_len)
            key_layer = layer_past[0][:batch, :, : nearest_32(layer_past_len + 1), :]

        key_layer_transposed = key_layer.transpose(-2, -1)
        if llm_mode == "prefill":
            attn_weights = query_layer @ key_layer_transposed
        else:
            # attn_matmul: q [1, heads, batch, hd] x k^T [batch, 1, hd, S] -> [1, heads, batch, S]
            attn_weights = torch.einsum("xhbd,bxds->xhbs", query_layer, key_layer_transposed)

        attn_weights = attn_weights * self.scalar
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = attn_weights * (1 / self.temperature)
        attn_weights = torch.softmax(attn_weights, dim=-1)

        ######################
        ### V CACHE UPDATE ###
        ######################
        if llm_mode == "prefill":
            fill_cache(layer_past[1], value_layer, user_id)
        elif llm_mode == "decode":
            update_cache(layer_past[1], value_layer, layer_past_len)
            value_layer = layer_past[1][:batch, :, : nearest_32(layer_past_len + 1), :]

        if llm_mode == "prefill":
            attn_output = attn_weights @ value_layer
        else:
            attn_output = torch.einsum("xhbs,bxsd->xhbd", attn_weights, value_layer)

        attn_output = nlp_concat_heads(attn_output)
        attn_output = attn_output @ self.dense_weights
        return attn_output, layer_past


class TtFalconDecoderLayer(nn.Module):
    def __init__(self, state_dict, base_url, layer_num, config, max_position_embeddings):
        super().__init__()
        self.self_attn = TtFalconAttention(
            state_dict, base_url, layer_num, config.hidden_size, config.num_attention_heads, max_position_embeddings
        )
        p = f"{base_url}.{layer_num}"
        self.ln_w = state_dict[f"{p}.input_layernorm.weight"]
        self.ln_b = state_dict[f"{p}.input_layernorm.bias"]
        self.h_to_4h = state_dict[f"{p}.mlp.dense_h_to_4h.weight"].t()
        self.fourh_to_h = state_dict[f"{p}.mlp.dense_4h_to_h.weight"].t()
        self.eps = config.layer_norm_epsilon

    def forward(self, hidden_states, attention_mask, llm_mode, user_id=0, layer_past=None, layer_past_len=0):
        residual = hidden_states
        ln = nn.functional.layer_norm(hidden_states, (hidden_states.shape[-1],), self.ln_w, self.ln_b, self.eps)
        attn_out, present = self.self_attn(ln, attention_mask, llm_mode, user_id, layer_past, layer_past_len)
        mlp_out = nn.functional.gelu(ln @ self.h_to_4h) @ self.fourh_to_h
        return residual + attn_out + mlp_out, present


class TtFalconCausalLM(nn.Module):
    def __init__(self, state_dict, base_url, num_layers, config, max_position_embeddings):
        super().__init__()
        self.config = config
        self.embedding_weights = state_dict[f"{base_url}.word_embeddings.weight"]
        self.layers = nn.ModuleList(
            [TtFalconDecoderLayer(state_dict, f"{base_url}.h", i, config, max_position_embeddings) for i in range(num_layers)]
        )
        self.ln_f_w = state_dict[f"{base_url}.ln_f.weight"]
        self.ln_f_b = state_dict[f"{base_url}.ln_f.bias"]
        self.lm_head = state_dict["lm_head.weight"].t()

    def model_preprocessing(self, llm_mode, input_ids, kv_cache_len, num_input_tokens):
        batch_size, sequence_size = input_ids.shape
        heads = self.config.num_attention_heads
        if llm_mode == "prefill":
            assert batch_size == 1 and sequence_size % 32 == 0 and kv_cache_len == 0
            attention_mask_bool = torch.ones(batch_size, 1, sequence_size, num_input_tokens, dtype=bool)
            attention_mask_bool = attention_mask_bool.triu(diagonal=1)
            attention_mask_bool_padded = torch.cat(
                (
                    attention_mask_bool,
                    torch.ones(batch_size, 1, sequence_size, sequence_size - num_input_tokens, dtype=bool),
                ),
                dim=-1,
            )
            attention_mask = (attention_mask_bool_padded * -1e3).repeat(1, heads, 1, 1)
            embeddings = self.embedding_weights[input_ids].unsqueeze(1)  # [1, 1, seq, hidden]
        elif llm_mode == "decode":
            assert batch_size % 32 == 0 and sequence_size == 1
            attention_mask_bool = torch.zeros(batch_size, 1, sequence_size, num_input_tokens, dtype=bool)
            num_max_tokens = nearest_32(kv_cache_len + 1)
            attention_mask_bool_padded = torch.cat(
                (
                    attention_mask_bool,
                    torch.ones(batch_size, 1, sequence_size, num_max_tokens - num_input_tokens, dtype=bool),
                ),
                dim=-1,
            )
            attention_mask = (attention_mask_bool_padded.transpose(0, 2) * -1e3).expand(-1, heads, -1, -1)
            embeddings = self.embedding_weights[input_ids.transpose(0, 1)].unsqueeze(1)  # [1, 1, batch, hidden]
        return embeddings, attention_mask

    def forward(self, input_embeddings, llm_mode, attention_mask, user_id=0, layer_past=None, layer_past_len=0):
        layer_output = input_embeddings
        for idx, layer in enumerate(self.layers):
            layer_output, _ = layer(layer_output, attention_mask, llm_mode, user_id, layer_past[idx], layer_past_len)
        layer_output = nn.functional.layer_norm(
            layer_output, (layer_output.shape[-1],), self.ln_f_w, self.ln_f_b, self.config.layer_norm_epsilon
        )
        return layer_output @ self.lm_head


def main():
    torch.manual_seed(0)
    config = FalconConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        multi_query=True,
        parallel_attn=True,
        new_decoder_architecture=False,
        alibi=False,
        bias=False,
        initializer_range=0.2,
    )
    hf = FalconForCausalLM(config).eval()
    state_dict = {k: v.detach() for k, v in hf.state_dict().items()}
    max_position_embeddings = 128
    head_dim = config.hidden_size // config.num_attention_heads
    model = TtFalconCausalLM(state_dict, "transformer", config.num_hidden_layers, config, max_position_embeddings)

    batch_size, num_input_tokens, prefill_len, max_new_tokens = 32, 9, 32, 8
    prompts = torch.randint(0, config.vocab_size, (batch_size, num_input_tokens))
    kv_cache = [
        (
            torch.zeros(batch_size, 1, max_position_embeddings, head_dim),
            torch.zeros(batch_size, 1, max_position_embeddings, head_dim),
        )
        for _ in range(config.num_hidden_layers)
    ]

    with torch.no_grad():
        # prefill one user at a time, prompts padded to 32
        output_ids = torch.zeros(batch_size, 1, dtype=torch.long)
        for user_id in range(batch_size):
            ids = torch.zeros(1, prefill_len, dtype=torch.long)
            ids[0, :num_input_tokens] = prompts[user_id]
            emb, mask = model.model_preprocessing("prefill", ids, 0, num_input_tokens)
            logits = model(emb, "prefill", mask, user_id=user_id, layer_past=kv_cache, layer_past_len=0)
            output_ids[user_id, 0] = logits[0, 0, num_input_tokens - 1].argmax()

        generated = [output_ids[:, 0].clone()]
        kv_cache_len = num_input_tokens
        last_logits = None
        for _ in range(max_new_tokens):
            emb, mask = model.model_preprocessing("decode", output_ids, kv_cache_len, kv_cache_len + 1)
            logits = model(emb, "decode", mask, layer_past=kv_cache, layer_past_len=kv_cache_len)
            last_logits = logits[0, 0]
            output_ids = last_logits.argmax(-1, keepdim=True)
            generated.append(output_ids[:, 0].clone())
            kv_cache_len += 1

    generated = torch.stack(generated, dim=1)
    print("mode:", "fixed" if FIXED else "buggy")
    for u in range(4):
        print(f"user {u}:", generated[u].tolist())
    print("last decode logits sum:", round(float(last_logits.sum()), 4))
    print("checksum:", int(generated.sum()))


if __name__ == "__main__":
    main()
