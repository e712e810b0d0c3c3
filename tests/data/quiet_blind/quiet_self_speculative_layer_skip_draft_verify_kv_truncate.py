# Citation: dilab-zju/self-speculative-decoding @688db8b74a782af21777b7ad5aeb399d7eb26faf
#   ("Draft & Verify: Lossless Large Language Model Acceleration via Self-Speculative Decoding"):
#   decoding.py (sample, base_generate, exact_self_speculative_generate), modeling_llama.py (LlamaAttention.forward,
#   LlamaDecoderLayer.forward eval path with _attn_skip_layer_id_set / _mlp_skip_layer_id_set, LlamaModel.forward,
#   LlamaForCausalLM.forward / self_draft / set_skip_layers). The file subclasses transformers ~4.33's Llama classes;
#   what it inherits from there is written out below as that version had it: LlamaAttention.__init__,
#   LlamaRotaryEmbedding (cos/sin cache sliced to seq_len), rotate_half, apply_rotary_pos_emb(q, k, cos, sin,
#   position_ids), repeat_kv, LlamaRMSNorm, LlamaMLP, _make_causal_mask, _expand_mask and
#   LlamaModel._prepare_decoder_attention_mask. Only the greedy branch of `sample` is kept (do_sample=False).
# Self-speculative decoding drafts with the model itself, skipping some attention and MLP sublayers
# (`with model.self_draft()`): a skipped attention layer returns no KV, so the draft's past_key_values holds None for
# it while the kept layers grow by one token per draft step, on top of a copy of the verified cache. The verify pass
# then feeds [last accepted token, draft tokens...] to the full model over the verified cache (no attention_mask
# argument: LlamaModel makes a ones mask over past + new and _prepare_decoder_attention_mask adds a causal mask offset
# by past_key_values_length). Keys of the rejected tail are cut off the cache (`k[:, :, :-(n - max_matched)]`), so
# the next step's past length, positions and causal offset all come from the trimmed cache.
# Self-check: the generated ids equal greedy decoding by a reference written as a double loop (each query attends keys
# 0..i, no cache, no mask), and equal base_generate; the logits of every full-model forward (prefill and every verify,
# rejected draft rows included) match that reference run on the tokens the cache holds plus the forward's input, and
# every draft forward matches it with the draft's layers skipped from the round's first draft token on.
import math
from contextlib import contextmanager
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN

torch.manual_seed(0)

enabled_draft = False
_attn_skip_layer_id_set = []
_mlp_skip_layer_id_set = []


# ---- transformers ~4.33 models/llama/modeling_llama.py (what modeling_llama.py imports) ----
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length: int = 0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: Optional[int] = None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings, device=self.inv_freq.device,
                                dtype=torch.get_default_dtype())

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :].to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :].to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)
        return (self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
                self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype))


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)  # [seq_len, dim]
    sin = sin.squeeze(1).squeeze(0)  # [seq_len, dim]
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


# ---- modeling_llama.py (self-speculative-decoding) ----
class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self._init_rope()

    def _init_rope(self):
        # rope_scaling is None for this config (newer configs report {"rope_type": "default"} for the same thing)
        base = self.config.rope_parameters["rope_theta"] if hasattr(self.config, "rope_parameters") \
            else getattr(self.config, "rope_theta", 10000)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, base=base,
                                               max_position_embeddings=self.max_position_embeddings)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False):
        bsz, q_len, _ = hidden_states.size()

        key_states = self.k_proj(hidden_states)
        query_states = self.q_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        if past_key_value is not None:
            # reuse k, v, self_attention
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)

        past_key_value = (key_states, value_states) if use_cache else None

        # repeat k/v heads if n_kv_heads < n_heads
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

        if attn_weights.size() != (bsz, self.num_heads, q_len, kv_seq_len):
            raise ValueError(f"Attention weights should be of size {(bsz, self.num_heads, q_len, kv_seq_len)}, "
                             f"but is {attn_weights.size()}")

        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, q_len, kv_seq_len):
                raise ValueError(f"Attention mask should be of size {(bsz, 1, q_len, kv_seq_len)}, "
                                 f"but is {attention_mask.size()}")
            attn_weights = attn_weights + attention_mask

        # upcast attention to fp32
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        attn_output = self.o_proj(attn_output)

        if not output_attentions:
            attn_weights = None
        return attn_output, attn_weights, past_key_value


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_id=0):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = LlamaAttention(config=config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layer_id = layer_id

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                draft_attn_skip_mask=None, draft_mlp_skip_mask=None, output_attentions=False, use_cache=False):
        # (the training branch, driven by draft_attn_skip_mask / draft_mlp_skip_mask, is left out: eval only)
        residual = hidden_states

        if enabled_draft and self.layer_id in _attn_skip_layer_id_set:
            hidden_states = residual
            present_key_value = None
        else:
            hidden_states = self.input_layernorm(hidden_states)

            # Self Attention
            hidden_states, self_attn_weights, present_key_value = self.self_attn(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_value=past_key_value,
                output_attentions=output_attentions,
                use_cache=use_cache,
            )
            hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states

        if enabled_draft and self.layer_id in _mlp_skip_layer_id_set:
            hidden_states = residual
        else:
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states

        outputs = (hidden_states,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, layer_id=i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # transformers ~4.33 LlamaModel._prepare_decoder_attention_mask
    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        # create causal mask
        # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, inputs_embeds.dtype,
                                                        device=inputs_embeds.device,
                                                        past_key_values_length=past_key_values_length)
        if attention_mask is not None:
            # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype,
                                              tgt_len=input_shape[-1]).to(inputs_embeds.device)
            combined_attention_mask = (expanded_attn_mask if combined_attention_mask is None
                                       else expanded_attn_mask + combined_attention_mask)
        return combined_attention_mask

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, draft_attn_skip_mask=None, draft_mlp_skip_mask=None):
        batch_size, seq_length = input_ids.shape

        seq_length_with_past = seq_length
        past_key_values_length = 0

        if past_key_values is not None:
            for past_key_value in past_key_values:
                if past_key_value is not None:
                    past_key_values_length = past_key_value[0].shape[2]
                    break
            seq_length_with_past = seq_length_with_past + past_key_values_length

        if position_ids is None:
            device = input_ids.device
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                        dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()

        inputs_embeds = self.embed_tokens(input_ids)
        # embed positions
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length_with_past), dtype=torch.bool,
                                        device=inputs_embeds.device)
        attention_mask = self._prepare_decoder_attention_mask(attention_mask, (batch_size, seq_length),
                                                              inputs_embeds, past_key_values_length)

        hidden_states = inputs_embeds
        next_decoder_cache = () if use_cache else None

        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            layer_outputs = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                          past_key_value=past_key_value, output_attentions=output_attentions,
                                          use_cache=use_cache, draft_attn_skip_mask=draft_attn_skip_mask,
                                          draft_mlp_skip_mask=draft_mlp_skip_mask)
            hidden_states = layer_outputs[0]
            if use_cache:
                next_decoder_cache += (layer_outputs[1],)

        hidden_states = self.norm(hidden_states)
        return hidden_states, (next_decoder_cache if use_cache else None)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.trace = []

    @contextmanager
    def self_draft(self, enabled=True, *args, **kwds):
        global enabled_draft
        enabled_draft = enabled
        try:
            yield None
        finally:
            enabled_draft = False

    def set_skip_layers(self, attn_skip_layer_id_set=None, mlp_skip_layer_id_set=None):
        if attn_skip_layer_id_set is not None:
            global _attn_skip_layer_id_set
            _attn_skip_layer_id_set = attn_skip_layer_id_set
        if mlp_skip_layer_id_set is not None:
            global _mlp_skip_layer_id_set
            _mlp_skip_layer_id_set = mlp_skip_layer_id_set

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, draft_attn_skip_mask=None, draft_mlp_skip_mask=None):
        hidden_states, next_cache = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                               position_ids=position_ids, past_key_values=past_key_values,
                                               use_cache=use_cache, draft_attn_skip_mask=draft_attn_skip_mask,
                                               draft_mlp_skip_mask=draft_mlp_skip_mask)
        logits = self.lm_head(hidden_states)
        logits = logits.float()
        # record (draft?, tokens already in the cache, input ids, logits) for the self-check
        past_len = 0
        if past_key_values is not None:
            past_len = next(kv[0].shape[2] for kv in past_key_values if kv is not None)
        self.trace.append((enabled_draft, past_len, input_ids[0].tolist(), logits[0].detach().clone()))
        return {"logits": logits, "past_key_values": next_cache}


# ---- decoding.py ----
def sample(logits, return_probs: bool = False, do_sample: bool = False, top_k: int = 50, top_p: float = 0.7,
           temperature: float = 0.7):
    assert not do_sample  # the top_k_top_p_filtering branch is not ported
    if return_probs:
        all_probs = logits.softmax(-1)
        probs, output_ids = torch.max(all_probs, dim=-1)
        return output_ids, probs
    else:
        output_ids = torch.argmax(logits, dim=-1)
        return output_ids


def base_generate(model, tokenizer, input_ids, max_new_tokens=10, do_sample=False, top_k=0, top_p=0.85,
                  temperature=0.2, early_stop=False):
    current_input_ids = input_ids
    generate_ids = torch.empty([input_ids.size(0), max_new_tokens], dtype=torch.long, device=input_ids.device)
    past_key_values = None
    with torch.no_grad():
        for step in range(max_new_tokens):
            output = model(input_ids=current_input_ids, past_key_values=past_key_values, return_dict=True,
                           use_cache=True)
            logits = output['logits'][:, -1:]
            output_ids = sample(logits, do_sample=do_sample, top_k=top_k, top_p=top_p, temperature=temperature)
            generate_ids[:, step] = output_ids
            current_input_ids = output_ids
            past_key_values = output['past_key_values']
    step = min(step + 1, max_new_tokens)
    generate_ids = generate_ids[:, :step]
    return {'generate_ids': generate_ids}


def exact_self_speculative_generate(model, tokenizer, input_ids, max_new_tokens=10, early_stop=False,
                                    max_step_draft=8, th_stop_draft=0.8, auto_th_stop_draft=True,
                                    auto_parameters=[1, 0.5, 0.9, 1e-2, 0.9], do_sample=False,
                                    do_sample_draft=False, top_k=0, top_p=0.85, temperature=0.2):
    step = 0
    step_draft = 0
    step_verify = 0

    current_input_ids = input_ids
    generate_ids = torch.empty([input_ids.size(0), max_new_tokens + max_step_draft], dtype=torch.long,
                               device=input_ids.device)
    draft_generate_ids = torch.empty([input_ids.size(0), max_step_draft + 1], dtype=torch.long,
                                     device=input_ids.device)
    past_key_values = None

    n_matched = 0
    n_drafted = 0
    tmp_n_matched = 0
    tmp_n_drafted = 0
    tmp_matchness = 0
    with torch.no_grad():
        while True:
            if step >= max_new_tokens:
                break

            if step == 0:
                # first token use full model
                output = model(input_ids=current_input_ids, past_key_values=past_key_values, return_dict=True,
                               use_cache=True)
                logits = output['logits']
                logits = logits[:, -1:]
                output_ids = sample(logits, do_sample=do_sample, top_k=top_k, top_p=top_p, temperature=temperature)
                generate_ids[:, step] = output_ids
                current_input_ids = output_ids
                past_key_values = output['past_key_values']
                step += 1
            else:
                draft_current_input_ids = current_input_ids
                draft_past_key_values = past_key_values
                draft_generate_ids[:, 0] = current_input_ids
                for step_draft in range(max_step_draft):
                    with model.self_draft():
                        draft_output = model(input_ids=draft_current_input_ids,
                                             past_key_values=draft_past_key_values, return_dict=True,
                                             use_cache=True)
                    draft_output_ids, draft_output_probs = sample(draft_output['logits'], return_probs=True,
                                                                  do_sample=do_sample_draft, top_k=top_k,
                                                                  top_p=top_p, temperature=temperature)
                    draft_generate_ids[:, step_draft + 1] = draft_output_ids
                    draft_current_input_ids = draft_output_ids
                    draft_past_key_values = draft_output['past_key_values']
                    if draft_output_probs.item() < th_stop_draft or step + step_draft + 2 >= max_new_tokens:
                        break

                drafted_n_tokens = step_draft + 1
                drafted_input_ids = draft_generate_ids[:, :drafted_n_tokens + 1]  # raft input + raft completion

                output = model(input_ids=drafted_input_ids, past_key_values=past_key_values, return_dict=True,
                               use_cache=True)
                logits = output['logits']
                output_ids = sample(logits, do_sample=do_sample, top_k=top_k, top_p=top_p, temperature=temperature)

                past_key_values = output['past_key_values']

                # including the one generated by the base model
                max_matched = ((output_ids[:, :-1] != drafted_input_ids[:, 1:]).cumsum(-1) == 0).sum(-1).item() + 1
                max_of_max_matched = output_ids.size(1)

                if max_of_max_matched != max_matched:
                    output_ids = output_ids[:, :max_matched]
                    past_key_values = [
                        (k[:, :, :-(max_of_max_matched - max_matched)], v[:, :, :-(max_of_max_matched - max_matched)])
                        for k, v in past_key_values
                    ]

                generate_ids[:, step:step + output_ids.size(1)] = output_ids
                current_input_ids = output_ids[:, -1:]

                step += output_ids.size(1)

                # remove one generated by the base model
                n_matched += max_matched - 1
                n_drafted += drafted_n_tokens
                tmp_n_matched += max_matched - 1
                tmp_n_drafted += drafted_n_tokens
                step_verify += 1

                if auto_th_stop_draft and step_verify % auto_parameters[0] == 0:
                    tmp_matchness = auto_parameters[1] * (tmp_matchness) + \
                        (1 - auto_parameters[1]) * ((max_matched - 1) / drafted_n_tokens)
                    if tmp_matchness < auto_parameters[2]:
                        new_th_stop_draft = th_stop_draft + auto_parameters[3]
                    else:
                        if drafted_n_tokens == max_step_draft:
                            new_th_stop_draft = th_stop_draft
                        else:
                            new_th_stop_draft = th_stop_draft - auto_parameters[3]
                    th_stop_draft = auto_parameters[4] * th_stop_draft + (1 - auto_parameters[4]) * new_th_stop_draft

    step = min(step, max_new_tokens)
    generate_ids = generate_ids[:, :step]
    return {'generate_ids': generate_ids, 'matchness': n_matched / n_drafted, 'num_drafted_tokens': n_drafted,
            'th_stop_draft': th_stop_draft}


# ---- a tiny Llama; the skipped sublayers are kept small so the draft agrees with the full model often ----
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
model = LlamaForCausalLM(config).eval()
ATTN_SKIP, MLP_SKIP = [1, 3], [2]
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            p.copy_(1 + 0.1 * torch.randn_like(p))
        else:
            p.normal_(0.0, 0.3)
    model.lm_head.weight.mul_(4.0)
    for i in ATTN_SKIP:
        model.model.layers[i].self_attn.o_proj.weight.mul_(0.15)
    for i in MLP_SKIP:
        model.model.layers[i].mlp.down_proj.weight.mul_(0.15)
model.set_skip_layers(attn_skip_layer_id_set=ATTN_SKIP, mlp_skip_layer_id_set=MLP_SKIP)


# ---- reference: no cache, no mask; each query attends keys 0..i. Positions from n_full on run as the draft does
# (its layers skipped); the ones before run through every layer, as the verified cache was written by the full model.
def ref_logits(tokens, n_full=None):
    m = model.model
    T = len(tokens)
    n_full = T if n_full is None else n_full
    x = m.embed_tokens(torch.tensor(tokens))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    ang = torch.arange(T).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda t: t * cos[:, None, :] + rotate_half(t) * sin[:, None, :]
    for li, layer in enumerate(m.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = rot(a.q_proj(h).view(T, a.num_heads, a.head_dim))
        k = rot(a.k_proj(h).view(T, a.num_key_value_heads, a.head_dim))
        v = a.v_proj(h).view(T, a.num_key_value_heads, a.head_dim)
        x_new = x.clone()
        for i in range(T):
            if i >= n_full and li in ATTN_SKIP:
                continue
            out = torch.zeros(a.num_heads, a.head_dim)
            for hh in range(a.num_heads):
                kv_h = hh // a.num_key_value_groups
                w = torch.softmax(k[: i + 1, kv_h] @ q[i, hh] / math.sqrt(a.head_dim), dim=0)
                out[hh] = w @ v[: i + 1, kv_h]
            x_new[i] = x[i] + a.o_proj(out.reshape(-1))
        x = x_new
        x_new = x.clone()
        for i in range(T):
            if i >= n_full and li in MLP_SKIP:
                continue
            x_new[i] = x[i] + layer.mlp(layer.post_attention_layernorm(x[i]))
        x = x_new
    return model.lm_head(m.norm(x))


with torch.no_grad():
    prompt = torch.randint(0, config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5))
    max_new_tokens = 24

    model.trace = []
    base = base_generate(model, None, prompt, max_new_tokens=max_new_tokens)["generate_ids"][0].tolist()

    model.trace = []
    out = exact_self_speculative_generate(model, None, prompt, max_new_tokens=max_new_tokens, max_step_draft=4,
                                          th_stop_draft=0.3, auto_th_stop_draft=True)
    spec = out["generate_ids"][0].tolist()
    trace = model.trace

    # greedy decoding by the reference, recomputed from scratch for every token
    seq = prompt[0].tolist()
    ref = []
    for _ in range(max_new_tokens):
        lg = ref_logits(seq)[-1]
        top2 = lg.topk(2).values
        assert top2[0] - top2[1] > 1e-3            # no near-ties for argmax to flip on
        nxt = int(lg.argmax())
        ref.append(nxt)
        seq.append(nxt)

    assert spec == ref, (spec, ref)
    assert base == ref, (base, ref)

    full = prompt[0].tolist() + spec
    n_verify = n_draft = n_rejecting = 0
    n_full = None
    draft_ids = []
    for is_draft, past_len, ids, logits in trace:
        if is_draft:
            if not draft_ids:
                n_full = past_len               # first draft step of a round: the verified cache's length
            draft_ids = draft_ids + ids
            tokens = full[:n_full] + draft_ids
            r = ref_logits(tokens, n_full=n_full)[past_len:]
            n_draft += 1
        else:
            draft_ids = []
            # the cache holds the first past_len tokens of the accepted sequence; ids follow them
            tokens = full[:past_len] + ids
            r = ref_logits(tokens)[past_len:]
            if past_len > 0:
                n_verify += 1
                if tokens != full[: len(tokens)]:
                    n_rejecting += 1
        assert torch.allclose(logits, r, atol=1e-4), (is_draft, past_len, (logits - r).abs().max())
    assert out["num_drafted_tokens"] > 0 and 0.0 < out["matchness"] < 1.0, out
    assert n_verify > 0 and n_draft > n_verify and n_rejecting > 0
    print(f"generated {spec}")
    print(f"verify passes {n_verify} (rejecting {n_rejecting}), draft passes {n_draft}, "
          f"matchness {out['matchness']:.2f}")
print("ok")
