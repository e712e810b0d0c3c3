# Citation: huggingface/optimum-habana#623 (commit d1e66b9aa62627aec0f43fdf67052a1b439e0434,
#   "Fix flash attention output for llama for padded batched inputs").
# Upstream: optimum/habana/transformers/models/llama/modeling_llama.py,
#   GaudiLlamaAttention.pre_attn_forward (use_flash_attention branch, "first token"),
#   with the mask built by GaudiLlamaModel.forward -> LlamaModel._prepare_decoder_attention_mask
#   (transformers 4.34) and the static-shape greedy loop of GaudiGenerationMixin (token_idx).
# Bug: on the first (prompt) forward, FusedSDPA was called with attn_mask=None and is_causal=True,
#   so the 4D causal+padding mask built from the left-padded batch's attention_mask was dropped and
#   real prompt tokens attended the left pad tokens (decode steps did get the mask).
# Fix: pass attention_mask to FusedSDPA and set is_causal=False on the first token as well.
#
# CPU stand-ins: FusedSDPA.apply (same positional signature: q, k, v, attn_mask, dropout_p,
# is_causal, scale) is written with torch's scaled_dot_product_attention; ht.sdp_kernel is a no-op
# context manager. Sizes are tiny; weights are random (seeded).
import contextlib
import math
import sys
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- HPU kernel stand-ins
class FusedSDPA:
    @staticmethod
    def apply(query, key, value, attn_mask, dropout_p, is_causal, scale):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )


class ht:
    @staticmethod
    def sdp_kernel(enable_recompute=False):
        return contextlib.nullcontext()


# ---------------------------------------------------------------- config
class LlamaConfig:
    vocab_size = 48
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    max_position_embeddings = 64
    rms_norm_eps = 1e-6
    rope_theta = 10000.0
    pretraining_tp = 1
    pad_token_id = 0
    output_attentions = False
    output_hidden_states = False
    use_cache = True
    use_return_dict = True


# ---------------------------------------------------------------- transformers 4.34 helpers
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos[position_ids].unsqueeze(1)
    sin = sin[position_ids].unsqueeze(1)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def apply_customized_rope(q, k, cos, sin, position_ids):
    # q.device.type != "hpu": fall back to the transformers implementation
    return apply_rotary_pos_emb(q, k, cos, sin, position_ids)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        t = torch.arange(seq_len, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


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


# ---------------------------------------------------------------- optimum-habana llama
def update(prev, cur, dim, idx, inp_seq_len):
    orig_cur = cur
    cur = cur.to(dtype=prev.dtype)
    if cur.shape[2] > 1 and cur.shape[2] <= prev.shape[2]:
        # Initialize
        prev[:, :, :inp_seq_len, :].copy_(cur)
        return orig_cur
    assert cur.shape[2] == 1, f"Cannot update kv-cache. Unsupported shapes. prev:{prev.shape} cur:{cur.shape}"
    if idx is not None:
        prev.index_copy_(dim, idx - 1, cur)
        prev_cast = prev.to(orig_cur.dtype)
        return prev_cast
    else:
        return torch.cat((prev, cur), dim=dim)


def gaudi_llama_repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1 or num_key_value_heads == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class Matmul(nn.Module):
    def forward(self, x, y):
        return torch.matmul(x, y)


class GaudiLlamaAttention(nn.Module):
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
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, self.max_position_embeddings, config.rope_theta)

        self.matmul_qk = Matmul()
        self.matmul_av = Matmul()
        self.past_key = None
        self.past_value = None
        self.inp_seq_len = -1
        self.register_buffer("norm_factor", torch.tensor(1.0 / math.sqrt(self.head_dim)), persistent=False)

    def pre_attn_forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_value: Optional[Tuple[torch.Tensor]] = None,
        output_attentions: bool = False,
        use_cache: bool = False,
        token_idx: Optional[torch.Tensor] = None,
        attn_softmax_bf16: Optional[bool] = False,
        reuse_cache: Optional[bool] = False,
        use_flash_attention: Optional[bool] = False,
        flash_attention_recompute: Optional[bool] = False,
    ):
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, -1, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            if token_idx is None:
                kv_seq_len += past_key_value[0].shape[-2]
            else:
                if reuse_cache:
                    kv_seq_len = past_key_value[0][-2]
                else:
                    kv_seq_len = past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_customized_rope(query_states, key_states, cos, sin, position_ids)

        if past_key_value is not None or reuse_cache:
            if reuse_cache:
                past_key = self.past_key
                past_value = self.past_value
            else:
                past_key = past_key_value[0]
                past_value = past_key_value[1]
            key_states = update(past_key, key_states, 2, token_idx, self.inp_seq_len)
            value_states = update(past_value, value_states, 2, token_idx, self.inp_seq_len)

        if use_cache:
            if reuse_cache:
                past_key_value = (self.past_key.shape, self.past_value.shape)
            else:
                past_key_value = (key_states.contiguous(), value_states.contiguous())
        else:
            past_key_value = None

        key_states = gaudi_llama_repeat_kv(key_states, self.num_key_value_groups)
        value_states = gaudi_llama_repeat_kv(value_states, self.num_key_value_groups)

        if use_flash_attention and FusedSDPA:
            if q_len == 1:
                # next token
                with ht.sdp_kernel(enable_recompute=False):
                    attn_output = FusedSDPA.apply(
                        query_states, key_states, value_states, attention_mask, 0.0, False, None
                    )
            else:
                # first token
                with ht.sdp_kernel(enable_recompute=flash_attention_recompute):
                    if FIXED:
                        attn_output = FusedSDPA.apply(
                            query_states, key_states, value_states, attention_mask, 0.0, False, None
                        )
                    else:
                        attn_output = FusedSDPA.apply(query_states, key_states, value_states, None, 0.0, True, None)
        else:
            attn_weights = self.matmul_qk(query_states, key_states.transpose(2, 3)) * self.norm_factor
            if attention_mask is not None:
                attn_weights = attn_weights + attention_mask
            attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
            attn_output = self.matmul_av(attn_weights, value_states)

        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        attn_output = self.o_proj(attn_output)
        return attn_output, None, past_key_value


class GaudiLlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GaudiLlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = GaudiLlamaAttention(config)
        self.mlp = GaudiLlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, token_idx=None, attn_softmax_bf16=False,
                reuse_cache=False, use_flash_attention=False, flash_attention_recompute=False):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_out, _, present_key_value = self.self_attn.pre_attn_forward(
            hidden_states, attention_mask, position_ids, past_key_value, output_attentions, use_cache,
            token_idx, attn_softmax_bf16, reuse_cache, use_flash_attention, flash_attention_recompute,
        )
        hidden_states = residual + attn_out
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + self.mlp(hidden_states)
        outputs = (hidden_states,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class GaudiLlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([GaudiLlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(
                input_shape, inputs_embeds.dtype, device=inputs_embeds.device,
                past_key_values_length=past_key_values_length,
            )
        if attention_mask is not None:
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1]).to(
                inputs_embeds.device
            )
            combined_attention_mask = (
                expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask + combined_attention_mask
            )
        return combined_attention_mask

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, token_idx=None, attn_softmax_bf16=False, reuse_cache=False,
                use_flash_attention=False, flash_attention_recompute=False):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        batch_size, seq_length = input_ids.shape

        seq_length_with_past = seq_length
        past_key_values_length = 0
        if past_key_values is not None:
            if reuse_cache:
                past_key_values_length = past_key_values[0][0][2]
            else:
                past_key_values_length = past_key_values[0][0].shape[2]
            seq_length_with_past = seq_length_with_past + past_key_values_length

        if position_ids is None:
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length, dtype=torch.long)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        else:
            position_ids = position_ids.view(-1, seq_length).long()

        inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length_with_past), dtype=torch.bool)
        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length
        )

        hidden_states = inputs_embeds
        next_decoder_cache = () if use_cache else None
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            layer_outputs = decoder_layer(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_value=past_key_value,
                use_cache=use_cache,
                token_idx=token_idx,
                attn_softmax_bf16=attn_softmax_bf16,
                reuse_cache=reuse_cache,
                use_flash_attention=use_flash_attention,
                flash_attention_recompute=flash_attention_recompute,
            )
            hidden_states = layer_outputs[0]
            if use_cache:
                next_decoder_cache += (layer_outputs[1],)
        hidden_states = self.norm(hidden_states)
        return hidden_states, next_decoder_cache


class GaudiLlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = GaudiLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, token_idx=None, trim_logits=False, attn_softmax_bf16=False,
                reuse_cache=False, use_flash_attention=False, flash_attention_recompute=False):
        hidden_states, past = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, use_cache=use_cache, token_idx=token_idx,
            attn_softmax_bf16=attn_softmax_bf16, reuse_cache=reuse_cache,
            use_flash_attention=use_flash_attention, flash_attention_recompute=flash_attention_recompute,
        )
        _, seq_len, _ = hidden_states.shape
        if seq_len > 1 and trim_logits:
            if token_idx is not None:
                hidden_states = hidden_states.index_select(1, token_idx - 1)
            else:
                hidden_states = hidden_states[:, -1, :]
        logits = self.lm_head(hidden_states).float()
        return {"logits": logits, "past_key_values": past}

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      token_idx=None, **kwargs):
        reuse_cache = kwargs.get("reuse_cache")
        if past_key_values:
            if token_idx is not None:
                input_ids = torch.index_select(input_ids, 1, token_idx - 1)
            else:
                input_ids = input_ids[:, -1:]
        elif reuse_cache and token_idx is not None:
            input_ids = input_ids[:, :token_idx]
            attention_mask = attention_mask[:, :token_idx]

        position_ids = kwargs.get("position_ids", None)
        if attention_mask is not None and position_ids is None:
            # create position_ids on the fly for batch generation
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_key_values:
                if token_idx is not None:
                    position_ids = torch.index_select(position_ids, 1, token_idx - 1)
                else:
                    position_ids = position_ids[:, -1].unsqueeze(-1)

        return {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "use_cache": kwargs.get("use_cache"),
            "attention_mask": attention_mask,
            "token_idx": token_idx,
            "trim_logits": kwargs.get("trim_logits"),
            "attn_softmax_bf16": kwargs.get("attn_softmax_bf16"),
            "reuse_cache": reuse_cache,
            "use_flash_attention": kwargs.get("use_flash_attention"),
            "flash_attention_recompute": kwargs.get("flash_attention_recompute"),
        }


# ---------------------------------------------------------------- GaudiGenerationMixin (static shapes, greedy)
def _update_model_kwargs_for_generation(outputs, model_kwargs):
    model_kwargs["first_token"] = False
    model_kwargs["past_key_values"] = outputs["past_key_values"]
    token_idx = model_kwargs.get("token_idx", None)
    if "attention_mask" in model_kwargs:
        attention_mask = model_kwargs["attention_mask"]
        if token_idx is not None:
            attention_mask.index_fill_(1, token_idx, 1)
        else:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        model_kwargs["attention_mask"] = attention_mask
    if token_idx is not None:
        token_idx.add_(1)
    return model_kwargs


@torch.no_grad()
def generate(model, input_ids, attention_mask, max_new_tokens, pad_token_id, **gen_kwargs):
    # static_shapes: pad inputs to max length, track the current position with token_idx
    model_kwargs = dict(gen_kwargs)
    token_idx = input_ids.shape[-1]
    model_kwargs["token_idx"] = torch.tensor(token_idx)
    input_ids = F.pad(input_ids, (0, max_new_tokens), value=pad_token_id)
    model_kwargs["attention_mask"] = F.pad(attention_mask, (0, max_new_tokens), value=0)
    model_kwargs["past_key_values"] = None
    step_logits = []
    for _ in range(max_new_tokens):
        model_inputs = model.prepare_inputs_for_generation(input_ids, **model_kwargs)
        outputs = model(**model_inputs)
        token_idx = model_kwargs["token_idx"]
        if outputs["logits"].shape[-2] > 1:
            next_token_logits = torch.index_select(outputs["logits"], -2, token_idx - 1).squeeze(-2)
        else:
            next_token_logits = outputs["logits"][:, -1, :]
        step_logits.append(next_token_logits)
        next_tokens = torch.argmax(next_token_logits, dim=-1)
        input_ids.index_copy_(1, token_idx, next_tokens.unsqueeze(-1))
        model_kwargs = _update_model_kwargs_for_generation(outputs, model_kwargs)
    return input_ids, torch.stack(step_logits, dim=1)


def main():
    config = LlamaConfig()
    model = GaudiLlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)

    # tokenizer(padding_side="left") output for a batch of two prompts of lengths 7 and 3
    pad = config.pad_token_id
    prompts = [[5, 17, 9, 23, 31, 12, 40], [14, 7, 29]]
    max_len = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (max_len - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

    out_ids, logits = generate(
        model, input_ids, attention_mask, max_new_tokens=6, pad_token_id=pad,
        use_cache=True, trim_logits=True, use_flash_attention=True, flash_attention_recompute=False,
        reuse_cache=False, attn_softmax_bf16=False,
    )
    print("generated ids:")
    for row in out_ids.tolist():
        print("  ", row)
    print("first-step logits (row 1, first 6):", [round(v, 4) for v in logits[1, 0, :6].tolist()])
    print("sum |logits| per row:", [round(v, 4) for v in logits.abs().sum(dim=(1, 2)).tolist()])


if __name__ == "__main__":
    main()
