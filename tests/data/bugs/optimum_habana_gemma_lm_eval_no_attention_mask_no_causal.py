# Citation: huggingface/optimum-habana#1556 (commit 90c9cbda582b0ee71bbd21a9c4806363dc8edd40,
#   "Fix accuracy regression in Gemma"); the regression came from huggingface/optimum-habana#1463
#   (commit 95042ac98, "Fix lm_eval script for starcoder and gemma").
# Upstream: optimum/habana/transformers/models/gemma/modeling_gemma.py, GaudiGemmaModel.forward
#   ("HPU specific mask generation" -> _gaudi_prepare_4d_causal_attention_mask from
#   optimum/habana/transformers/modeling_attn_mask_utils.py), consumed by
#   GaudiGemmaAttention.pre_attn_forward (eager path); caller: examples/text-generation/run_lm_eval.py
#   HabanaModelAdapter._model_call, which runs the model on bucket-padded token ids without an
#   attention_mask.
# Bug: the 4D mask was only built when `attention_mask is not None`; with attention_mask=None (the
#   lm_eval call) no causal mask was made at all, so the eager attention added nothing and every
#   token attended the whole (bucket-padded) sequence, future tokens and pad tokens included.
# Fix: build the mask when `attention_mask is None or attention_mask.dim() != 4`;
#   _gaudi_prepare_4d_causal_attention_mask(None, ...) returns the causal 4D mask (to_causal_4d).
#
# CPU only: FusedSDPA is unavailable (as on a non-HPU host), so the eager attention path runs,
# exactly as upstream does when use_flash_attention is off. Tiny sizes, random seeded weights.
import math
import sys
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

FusedSDPA = None  # habana_frameworks not importable on CPU


class GemmaConfig:
    vocab_size = 48
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 8
    max_position_embeddings = 64
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    attention_dropout = 0.0
    pad_token_id = 0
    eos_token_id = 1
    output_attentions = False
    output_hidden_states = False
    use_cache = True
    use_return_dict = True
    model_type = "gemma"


# ---------------------------------------------------------------- modeling_attn_mask_utils (optimum-habana)
class GaudiAttentionMaskConverter:
    def __init__(self, is_causal: bool, sliding_window: Optional[int] = None):
        self.is_causal = is_causal
        self.sliding_window = sliding_window

    @staticmethod
    def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0, sliding_window=None):
        bsz, tgt_len = input_ids_shape
        mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
        mask_cond = torch.arange(mask.size(-1), device=device)
        mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
        mask = mask.to(dtype)
        if past_key_values_length > 0:
            mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
        if sliding_window is not None:
            diagonal = past_key_values_length - sliding_window - 1
            row_indices = torch.arange(mask.size(0), device=mask.device).view(-1, 1)
            col_indices = torch.arange(mask.size(1), device=mask.device)
            context_mask = (col_indices <= row_indices + diagonal).bool().expand_as(mask)
            mask.masked_fill_(context_mask, torch.finfo(dtype).min)
        return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)

    @staticmethod
    def _expand_mask(mask, dtype, tgt_len=None):
        bsz, src_len = mask.size()
        tgt_len = tgt_len if tgt_len is not None else src_len
        expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
        inverted_mask = 1.0 - expanded_mask
        return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)

    def to_causal_4d(self, batch_size, query_length, key_value_length, dtype, device="cpu"):
        input_shape = (batch_size, query_length)
        past_key_values_length = key_value_length - query_length
        causal_4d_mask = None
        if input_shape[-1] > 1 or self.sliding_window is not None:
            causal_4d_mask = self._make_causal_mask(
                input_shape, dtype, device=device, past_key_values_length=past_key_values_length,
                sliding_window=self.sliding_window,
            )
        return causal_4d_mask

    def to_4d(self, attention_mask_2d, query_length, dtype, key_value_length=None):
        input_shape = (attention_mask_2d.shape[0], query_length)
        device = attention_mask_2d.device
        if (input_shape[-1] > 1 or self.sliding_window is not None) and self.is_causal:
            past_key_values_length = key_value_length - query_length
            causal_4d_mask = self._make_causal_mask(
                input_shape, dtype, device=device, past_key_values_length=past_key_values_length,
                sliding_window=self.sliding_window,
            )
            bsz, src_len = attention_mask_2d.size()
            tgt_len = input_shape[-1] if input_shape[-1] is not None else src_len
            bool_mask = attention_mask_2d != 1.0
            expanded_attn_mask = bool_mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(device=device)
            return causal_4d_mask.masked_fill(expanded_attn_mask, torch.finfo(dtype).min)
        return self._expand_mask(attention_mask_2d, dtype, tgt_len=input_shape[-1]).to(device)


def _gaudi_prepare_4d_causal_attention_mask(
    attention_mask: Optional[torch.Tensor],
    input_shape: Union[torch.Size, Tuple, List],
    inputs_embeds: torch.Tensor,
    past_key_values_length: int,
    sliding_window: Optional[int] = None,
):
    attn_mask_converter = GaudiAttentionMaskConverter(is_causal=True, sliding_window=sliding_window)
    key_value_length = input_shape[-1] + past_key_values_length
    if attention_mask is not None and len(attention_mask.shape) == 2:
        attention_mask = attn_mask_converter.to_4d(
            attention_mask, input_shape[-1], key_value_length=key_value_length, dtype=inputs_embeds.dtype
        )
    elif attention_mask is not None and len(attention_mask.shape) == 4:
        inverted_mask = 1.0 - attention_mask
        attention_mask = inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(inputs_embeds.dtype).min)
    else:
        attention_mask = attn_mask_converter.to_causal_4d(
            input_shape[0], input_shape[-1], key_value_length, dtype=inputs_embeds.dtype, device=inputs_embeds.device
        )
    return attention_mask


# ---------------------------------------------------------------- model pieces
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class GaudiRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(config.max_position_embeddings, None, torch.float32)

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos_cached = emb.cos().to(dtype)
        self._sin_cached = emb.sin().to(dtype)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len, x.device, x.dtype)
        return self._cos_cached[:seq_len].to(x.dtype), self._sin_cached[:seq_len].to(x.dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def gaudi_gemma_repeat_kv(query_states, key_states, value_states, attention_mask, n_rep):
    batch, num_key_value_heads, kv_len, head_dim = key_states.shape
    if n_rep == 1 or num_key_value_heads == 1:
        return query_states, key_states, value_states, attention_mask
    new_kv_shape = (batch, num_key_value_heads, 1, kv_len, head_dim)
    key_states = key_states.reshape(new_kv_shape)
    value_states = value_states.reshape(new_kv_shape)
    batch, _, q_len, head_dim = query_states.shape
    new_q_shape = (batch, num_key_value_heads, n_rep, q_len, head_dim)
    query_states = query_states.reshape(new_q_shape)
    if attention_mask is not None:
        # Add groups dim and set to 1
        attention_mask = attention_mask.unsqueeze(1)
    return query_states, key_states, value_states, attention_mask


class Matmul(nn.Module):
    def forward(self, x, y):
        return torch.matmul(x, y)


class KVCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.inp_seq_len = -1

    def update(self, prev, cur, dim, idx, inp_seq_len):
        orig_cur = cur
        if prev.shape == cur.shape:
            prev.copy_(cur)
            return orig_cur
        if cur.shape[2] > 1 and cur.shape[2] <= prev.shape[2]:
            prev[:, :, :inp_seq_len, :].copy_(cur)
            return orig_cur
        if idx is not None:
            prev.index_copy_(dim, idx - 1, cur)
            return prev
        return torch.cat((prev, cur), dim=dim)


class GaudiGemmaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.matmul_qk = Matmul()
        self.matmul_av = Matmul()
        self.k_cache = KVCache()
        self.v_cache = KVCache()
        self.inp_seq_len = -1
        self.norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.rotary_emb = GaudiRotaryEmbedding(config=config)

    def pre_attn_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                         output_attentions=False, use_cache=False, cache_position=None, token_idx=None,
                         attn_softmax_bf16=False, reuse_cache=False, use_flash_attention=False,
                         flash_attention_recompute=False, flash_attention_causal_mask=False, cache_idx=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            if token_idx is None:
                kv_seq_len += past_key_value[0].shape[-2]
            else:
                kv_seq_len = past_key_value[0][-2] if reuse_cache else past_key_value[0].shape[-2]

        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos[position_ids], sin[position_ids])

        if use_cache:
            if past_key_value is None:
                past_key = torch.zeros(key_states.shape, dtype=self.k_proj.weight.dtype)
                past_value = torch.zeros(key_states.shape, dtype=self.k_proj.weight.dtype)
                past_key_value = (past_key, past_value)
            key_states = self.k_cache.update(past_key_value[0], key_states, 2, token_idx, self.inp_seq_len)
            value_states = self.v_cache.update(past_key_value[1], value_states, 2, token_idx, self.inp_seq_len)
            if token_idx is None:
                past_key_value = (key_states, value_states)
        else:
            past_key_value = None

        # use_flash_attention and FusedSDPA -> FusedSDPA is None here: eager path
        query_states, key_states, value_states, attention_mask = gaudi_gemma_repeat_kv(
            query_states, key_states, value_states, attention_mask, self.num_key_value_groups
        )
        attn_weights = self.matmul_qk(query_states, key_states.transpose(-2, -1)) * self.norm_factor
        if attention_mask is not None:  # no matter the length, we just slice it
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            if cache_position is not None:
                causal_mask = attention_mask[:, :, cache_position, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask
        if attn_softmax_bf16:
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=query_states.dtype)
        else:
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = self.matmul_av(attn_weights, value_states)
        attn_output = attn_output.reshape(bsz, -1, q_len, self.head_dim)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, -1)
        attn_output = self.o_proj(attn_output)
        return attn_output, None, past_key_value


class GaudiGemmaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def pre_mlp_forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GaudiGemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GaudiGemmaAttention(config, layer_idx)
        self.mlp = GaudiGemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cache_position=None, token_idx=None,
                attn_softmax_bf16=False, reuse_cache=False, use_flash_attention=False,
                flash_attention_recompute=False, flash_attention_causal_mask=False, cache_idx=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, present_key_value = self.self_attn.pre_attn_forward(
            hidden_states, attention_mask, position_ids, past_key_value, output_attentions, use_cache,
            cache_position, token_idx, attn_softmax_bf16, reuse_cache, use_flash_attention,
            flash_attention_recompute, flash_attention_causal_mask, cache_idx,
        )
        residual.add_(hidden_states)
        hidden_states = residual
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp.pre_mlp_forward(hidden_states)
        residual.add_(hidden_states)
        hidden_states = residual
        outputs = (hidden_states,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class GaudiGemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([GaudiGemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache_position=None, token_idx=None,
                attn_softmax_bf16=False, reuse_cache=False, use_flash_attention=False,
                flash_attention_recompute=False, flash_attention_causal_mask=False, cache_idx=None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        batch_size, seq_length = input_ids.shape[:2]
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        past_seen_tokens = 0
        if past_key_values is not None and use_cache:
            past_seen_tokens = past_key_values[0][0][2] if reuse_cache else past_key_values[0][0].shape[2]

        cache_position = None
        if position_ids is None:
            position_ids = torch.arange(past_seen_tokens, seq_length + past_seen_tokens, dtype=torch.long)
            position_ids = position_ids.unsqueeze(0)

        # HPU specific mask generation
        if FIXED:
            build_mask = attention_mask is None or attention_mask.dim() != 4
        else:
            build_mask = attention_mask is not None and attention_mask.dim() != 4
        if build_mask:
            attention_mask = _gaudi_prepare_4d_causal_attention_mask(
                attention_mask,
                input_ids.shape if input_ids is not None else (batch_size, seq_length),
                inputs_embeds,
                past_seen_tokens,
            )

        hidden_states = inputs_embeds
        normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer

        next_decoder_cache = ()
        for layer_idx, decoder_layer in enumerate(self.layers):
            layer_outputs = decoder_layer(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_value=None if past_key_values is None else past_key_values[layer_idx],
                use_cache=use_cache,
                cache_position=cache_position,
                token_idx=token_idx,
                attn_softmax_bf16=attn_softmax_bf16,
                reuse_cache=reuse_cache,
                use_flash_attention=use_flash_attention,
                flash_attention_recompute=flash_attention_recompute,
                flash_attention_causal_mask=flash_attention_causal_mask,
                cache_idx=cache_idx,
            )
            hidden_states = layer_outputs[0]
            if use_cache:
                next_decoder_cache += (layer_outputs[1],)
        hidden_states = self.norm(hidden_states)
        return hidden_states, next_decoder_cache


class GaudiGemmaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = GaudiGemmaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, reuse_cache=None, token_idx=None, use_flash_attention=False,
                flash_attention_recompute=False, flash_attention_causal_mask=False, attn_softmax_bf16=False,
                num_logits_to_keep=0):
        hidden_states, past = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, reuse_cache=reuse_cache,
            token_idx=token_idx, use_flash_attention=use_flash_attention,
            flash_attention_recompute=flash_attention_recompute,
            flash_attention_causal_mask=flash_attention_causal_mask, attn_softmax_bf16=attn_softmax_bf16,
        )
        logits = self.lm_head(hidden_states[:, -num_logits_to_keep:, :]).float()
        return {"logits": logits, "past_key_values": past}


# ---------------------------------------------------------------- run_lm_eval.py HabanaModelAdapter
class HabanaModelAdapter:
    def __init__(self, model, buckets, use_cache=True, reuse_cache=False, static_shapes=True):
        self.model = model
        self.buckets = sorted(buckets)
        self.static_shapes = static_shapes
        self.model_inputs = {"use_cache": use_cache}
        self.model_inputs.update({"reuse_cache": reuse_cache})
        self.model_inputs.update({"attn_softmax_bf16": False})
        self.model_inputs.update(
            {"use_flash_attention": False, "flash_attention_recompute": False, "flash_attention_causal_mask": False}
        )

    def find_bucket(self, length):
        return [b for b in self.buckets if b >= length][0]

    @torch.no_grad()
    def _model_call(self, inps):
        bs, seq_length = inps.shape
        padding_length = 0
        if self.static_shapes:
            bucket_length = self.find_bucket(seq_length)
            padding_length = bucket_length - seq_length
            inps = F.pad(inps, (0, padding_length), value=self.model.config.pad_token_id)
        logits = self.model(inps, **self.model_inputs)["logits"].cpu()
        if self.static_shapes and padding_length > 0:
            logits = logits[:, :-padding_length, :]
        return logits.to(torch.float32)

    def loglikelihood_tokens(self, requests):
        # lm_eval HFLM._loglikelihood_tokens (causal): inp = (context + continuation)[:-1],
        # batch right-padded, logprobs of the continuation tokens summed
        inps, cont_lens, inplens = [], [], []
        for context_enc, continuation_enc in requests:
            inp = torch.tensor((context_enc + continuation_enc)[:-1], dtype=torch.long)
            inps.append(inp)
            cont_lens.append(continuation_enc)
            inplens.append(inp.shape[0])
        max_len = max(inplens)
        batched = torch.stack([F.pad(x, (0, max_len - x.shape[0]), value=0) for x in inps])
        multi_logits = F.log_softmax(self._model_call(batched), dim=-1)
        results = []
        for logits, inplen, cont_toks in zip(multi_logits, inplens, cont_lens):
            contlen = len(cont_toks)
            logits = logits[inplen - contlen : inplen].unsqueeze(0)
            greedy_tokens = logits.argmax(dim=-1)
            cont = torch.tensor(cont_toks, dtype=torch.long).unsqueeze(0)
            max_equal = bool((greedy_tokens == cont).all())
            ll = torch.gather(logits, 2, cont.unsqueeze(-1)).squeeze(-1).sum()
            results.append((float(ll), max_equal))
        return results


def main():
    config = GemmaConfig()
    model = GaudiGemmaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)

    adapter = HabanaModelAdapter(model, buckets=[16, 32], use_cache=True, reuse_cache=False)
    requests = [
        ([2, 17, 9, 23, 31, 12, 40, 8], [5, 44, 19]),
        ([2, 14, 7, 29, 33], [21, 6]),
        ([2, 11, 36, 4, 27, 30, 15, 22, 10, 45], [13, 3, 38, 41]),
    ]
    results = adapter.loglikelihood_tokens(requests)
    for i, (ll, greedy) in enumerate(results):
        print(f"request {i}: loglikelihood = {ll:.4f}  greedy = {greedy}")
    print("total loglikelihood:", round(sum(r[0] for r in results), 4))


if __name__ == "__main__":
    main()
