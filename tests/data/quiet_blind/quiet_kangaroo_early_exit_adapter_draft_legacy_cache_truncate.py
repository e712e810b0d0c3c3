# Correct program (quiet batch quiet-r83b).
# Ported from Equationliu/Kangaroo @4f0949d46e780af2de8cff9efa76d04e1a31d947:
#   evaluation/inference_kangaroo.py (kangaroo_forward: prefill, draft loop with early stop, big-model verify,
#   greedy acceptance, "Post process KV-cache" truncation of both legacy caches), kangaroo/earlyexit.py
#   (forward_draft_or_large_model: shallow layers for a draft token, deep layers for the exited features, each
#   with _prepare_decoder_attention_mask over an all-ones mask and the cache length as past_key_values_length),
#   kangaroo/adapter.py (forward_early_stop: the adapter's own legacy cache and causal mask).
#   The decoder layer / mask helpers follow transformers 4.3x modeling_llama (_make_causal_mask, _expand_mask,
#   eager softmax over attn_weights + attention_mask), trimmed; the adapter is one decoder layer plus a norm.
# Self-check: the tokens equal plain greedy decoding of the full model (a causal double loop, no cache), and
# every draft logit the adapter produced equals the shallow layers + adapter run alone on that prefix.
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

torch.manual_seed(0)


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


def _prepare_decoder_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    combined_attention_mask = None
    if input_shape[-1] > 1:
        combined_attention_mask = _make_causal_mask(
            input_shape, inputs_embeds.dtype, device=inputs_embeds.device, past_key_values_length=past_key_values_length
        )
    if attention_mask is not None:
        expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1])
        combined_attention_mask = (
            expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask + combined_attention_mask
        )
    return combined_attention_mask


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim, max_pos=512, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        emb = torch.cat((torch.outer(torch.arange(max_pos).float(), inv_freq),) * 2, dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def apply(self, q, k, position_ids):
        cos, sin = self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, self.nh = config.hidden_size, config.num_attention_heads
        self.hd = d // self.nh
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d), RMSNorm(d)
        self.rotary = Rotary(self.hd)

    def attn(self, x, attention_mask, position_ids, past_key_value):
        bsz, q_len, _ = x.shape
        q = self.q_proj(x).view(bsz, q_len, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(bsz, q_len, self.nh, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(bsz, q_len, self.nh, self.hd).transpose(1, 2)
        q, k = self.rotary.apply(q, k, position_ids)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        past_key_value = (k, v)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out), past_key_value

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=True):
        a, present = self.attn(self.input_layernorm(hidden_states), attention_mask, position_ids, past_key_value)
        h = hidden_states + a
        y = self.post_attention_layernorm(h)
        return (h + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)), present)


class Inner(nn.Module):
    def __init__(self, config, n_layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(n_layers)])
        self.norm = RMSNorm(config.hidden_size)


class EarlyExitLlamaForCausalLM(nn.Module):
    """kangaroo/earlyexit.py (the base model, with the prefill forward and forward_draft_or_large_model)."""

    def __init__(self, config, early_exit_layer):
        super().__init__()
        self.model = Inner(config, config.num_hidden_layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.early_exit_layer = early_exit_layer
        self.past_key_values = None

    def __call__(self, input_ids, position_ids):  # prefill: LlamaForCausalLM.forward(output_hidden_states=True)
        bsz, L = input_ids.shape
        h = self.model.embed_tokens(input_ids)
        mask = _prepare_decoder_attention_mask(torch.ones(bsz, L, dtype=torch.bool), (bsz, L), h, 0)
        hidden_states, presents = (h,), []
        for layer in self.model.layers:
            h, present = layer(h, attention_mask=mask, position_ids=position_ids)
            presents.append(present)
            hidden_states += (h,)
        h = self.model.norm(h)
        return self.lm_head(h), presents, hidden_states[:-1] + (h,)

    def forward_draft_or_large_model(self, in_tokens_small=None, in_features_large=None, position_ids=None):
        use_cache = True
        assert self.past_key_values is not None
        if in_tokens_small is not None:
            batch_size, seq_length = in_tokens_small.shape
        else:
            batch_size, seq_length, _ = in_features_large.shape
        focu_layer = 0 if in_tokens_small is not None else self.early_exit_layer
        past_key_values_length = self.past_key_values[focu_layer][0].shape[2]
        seq_length_with_past = seq_length + past_key_values_length
        if in_tokens_small is not None:
            inputs_embeds = self.model.embed_tokens(in_tokens_small)
        attention_mask = torch.ones((batch_size, seq_length_with_past), dtype=torch.bool)
        attention_mask = _prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length),
            inputs_embeds if in_tokens_small is not None else in_features_large, past_key_values_length,
        )
        hidden_states = inputs_embeds if in_tokens_small is not None else in_features_large
        LAYERS = self.model.layers[: self.early_exit_layer] if in_tokens_small is not None else self.model.layers[self.early_exit_layer :]
        for idx, decoder_layer in enumerate(LAYERS):
            layer_idx = idx if in_tokens_small is not None else idx + self.early_exit_layer
            past_key_value = self.past_key_values[layer_idx]
            layer_outputs = decoder_layer(
                hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                past_key_value=past_key_value, use_cache=use_cache,
            )
            hidden_states = layer_outputs[0]
            self.past_key_values[layer_idx] = layer_outputs[1]
        if in_features_large is not None:
            return hidden_states, self.model.norm(hidden_states)
        return hidden_states


class AdapterModel(nn.Module):
    """kangaroo/adapter.py, trimmed to one decoder layer and a norm."""

    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(config)])
        self.norm = RMSNorm(config.hidden_size)

    def forward_early_stop(self, inputs_embeds=None, position_ids=None, past_key_values=None, use_cache=None):
        batch_size, seq_length, _ = inputs_embeds.shape
        seq_length_with_past = seq_length
        past_key_values_length = 0
        if past_key_values is not None:
            past_key_values_length = past_key_values[0][0].shape[2]
            seq_length_with_past = seq_length_with_past + past_key_values_length
        position_ids = position_ids.view(-1, seq_length).long()
        attention_mask = torch.ones((batch_size, seq_length_with_past), dtype=torch.bool)
        attention_mask = _prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length
        )
        hidden_states = inputs_embeds
        next_decoder_cache = ()
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(
                hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                past_key_value=past_key_value, use_cache=use_cache,
            )
            next_decoder_cache += (present,)
        return self.norm(hidden_states), next_decoder_cache


class KangarooModel(nn.Module):
    def __init__(self, config, early_exit_layer):
        super().__init__()
        self.base_model = EarlyExitLlamaForCausalLM(config, early_exit_layer)
        self.adapter_model = AdapterModel(config)
        self.head_model = self.base_model.lm_head


DRAFT_LOG = []  # (tokens the draft saw, adapter logits) for the self-check


def kangaroo_forward(context_tokens, model, token_eos, max_new_tokens, max_length=128, EARLY_STOP_LAYER=2,
                     SPECULATIVE_DECODING_STEPS=6, threshold=0.6):
    batch_size, context_length = context_tokens.shape
    global_tokens = torch.ones((batch_size, max_length), dtype=torch.long) * token_eos
    global_position_ids = torch.LongTensor([[i for i in range(max_length)]])
    accept_length_list = [1]
    start_index = context_length
    global_tokens[:, :start_index] = context_tokens

    with torch.no_grad():
        position_ids = global_position_ids[:, :start_index]
        logits, presents, hidden_states = model.base_model(context_tokens, position_ids=position_ids)
        model.base_model.past_key_values = list(presents)
        global_tokens[:, start_index] = torch.argmax(logits[:, -1, :], dim=-1).item()
        hidden_state_early = hidden_states[EARLY_STOP_LAYER]
        hidden_state, adapter_past_key_values = model.adapter_model.forward_early_stop(
            inputs_embeds=hidden_state_early[:, :, :], position_ids=global_position_ids[:, :context_length], use_cache=True
        )

    with torch.no_grad():
        max_infer_steps = min(max_length, start_index + max_new_tokens)
        stop = False
        while start_index < max_infer_steps - 1 - SPECULATIVE_DECODING_STEPS:
            start_index_copy = start_index
            end_index = start_index + 1
            # STEP 1: Small model decoding
            for step in range(1 + SPECULATIVE_DECODING_STEPS):
                assert adapter_past_key_values[0][0].shape[2] <= end_index - 1
                in_tokens_small = global_tokens[:, end_index - 1 : end_index]
                if adapter_past_key_values[0][0].shape[2] < end_index - 1:
                    position_ids = global_position_ids[:, start_index - 1 : end_index]
                    hidden_state_early_last = exited_hidden_states[:, -1:, :]
                else:
                    position_ids = global_position_ids[:, end_index - 1 : end_index]
                    hidden_state_early_last = None
                hidden_state_early = model.base_model.forward_draft_or_large_model(
                    in_tokens_small=in_tokens_small[:, -1:], position_ids=position_ids[:, -1:]
                )
                if step == 0:
                    exited_hidden_states = None
                exited_hidden_states = (
                    hidden_state_early if exited_hidden_states is None else torch.cat([exited_hidden_states, hidden_state_early], dim=1)
                )
                if hidden_state_early_last is not None:
                    hidden_state_early = torch.cat([hidden_state_early_last, hidden_state_early], dim=1)
                if step == SPECULATIVE_DECODING_STEPS or (step > 0 and predict_score < threshold):
                    break
                hidden_state, adapter_past_key_values = model.adapter_model.forward_early_stop(
                    inputs_embeds=hidden_state_early, position_ids=position_ids,
                    past_key_values=adapter_past_key_values, use_cache=True,
                )
                predict_logits = model.head_model(hidden_state[:, -1:, :]).float()
                DRAFT_LOG.append((global_tokens[0, :end_index].clone(), predict_logits[0, -1].clone()))
                global_tokens[:, end_index] = torch.argmax(predict_logits[:, -1, :], dim=-1)
                end_index += 1
                predict_score = predict_logits.softmax(dim=-1).max().item()

            # STEP 2: Big model inference
            position_ids = global_position_ids[:, start_index:end_index]
            assert model.base_model.past_key_values[EARLY_STOP_LAYER][0].shape[2] == start_index
            assert exited_hidden_states.shape[1] == position_ids.shape[1]
            hidden_state_, hidden_state = model.base_model.forward_draft_or_large_model(
                in_features_large=exited_hidden_states, position_ids=position_ids
            )
            logits = model.head_model(hidden_state).float()
            output_tokens = torch.argmax(logits[:, :, :], dim=-1)

            output_lenght = end_index - start_index
            for i in range(output_lenght):
                if i == output_lenght - 1 or output_tokens[0, i] == token_eos or output_tokens[0, i] != global_tokens[0, start_index + 1 + i]:
                    global_tokens[0, start_index + 1 + i] = output_tokens[0, i]
                    start_index = start_index + 1 + i
                    if output_tokens[0, i] == token_eos:
                        stop = True
                    break
            accept_length_list.append(start_index - start_index_copy)

            # STEP 4: Post process KV-cache
            if model.base_model.past_key_values[0][0].shape[2] > start_index:
                model.base_model.past_key_values = [
                    (k[:, :, :start_index, :], v[:, :, :start_index, :]) for k, v in model.base_model.past_key_values
                ]
            if adapter_past_key_values[0][0].shape[2] > start_index:
                adapter_past_key_values = tuple(
                    (k[:, :, :start_index, :], v[:, :, :start_index, :]) for k, v in adapter_past_key_values
                )
            if stop:
                break

    output_ids = global_tokens[0, : start_index + 1].tolist()
    return output_ids, accept_length_list


# ---------------------------------------------------------------- reference: causal double loop, no cache
@torch.no_grad()
def ref_layer(layer, h):
    L = h.shape[1]
    x = layer.input_layernorm(h)
    q = layer.q_proj(x).view(1, L, layer.nh, layer.hd).transpose(1, 2)
    k = layer.k_proj(x).view(1, L, layer.nh, layer.hd).transpose(1, 2)
    v = layer.v_proj(x).view(1, L, layer.nh, layer.hd).transpose(1, 2)
    q, k = layer.rotary.apply(q, k, torch.arange(L)[None])
    o = torch.zeros_like(q)
    for i in range(L):
        w = (q[:, :, i : i + 1] @ k[:, :, : i + 1].transpose(-1, -2)) / math.sqrt(layer.hd)
        o[:, :, i] = (w.softmax(-1) @ v[:, :, : i + 1])[:, :, 0]
    h = h + layer.o_proj(o.transpose(1, 2).reshape(1, L, -1))
    y = layer.post_attention_layernorm(h)
    return h + layer.down_proj(F.silu(layer.gate_proj(y)) * layer.up_proj(y))


@torch.no_grad()
def ref_full_logits(model, tokens):
    h = model.base_model.model.embed_tokens(tokens[None])
    for layer in model.base_model.model.layers:
        h = ref_layer(layer, h)
    return model.head_model(model.base_model.model.norm(h))[0, -1]


@torch.no_grad()
def ref_draft_logits(model, tokens, early):
    h = model.base_model.model.embed_tokens(tokens[None])
    for layer in model.base_model.model.layers[:early]:
        h = ref_layer(layer, h)
    h = ref_layer(model.adapter_model.layers[0], h)
    return model.head_model(model.adapter_model.norm(h))[0, -1]


if __name__ == "__main__":
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
    EARLY = 2
    model = KangarooModel(config, EARLY).eval()
    with torch.no_grad():
        model.head_model.weight.mul_(6.0)
        # an adapter that imitates the deep layers, so that drafts are often accepted
        model.adapter_model.layers[0].load_state_dict(model.base_model.model.layers[EARLY].state_dict())
        model.adapter_model.norm.load_state_dict(model.base_model.model.norm.state_dict())
    token_eos = config.vocab_size - 1
    prompt = torch.randint(0, config.vocab_size - 1, (1, 6))
    n_new = 30
    out, accept = kangaroo_forward(prompt, model, token_eos, n_new, EARLY_STOP_LAYER=EARLY, SPECULATIVE_DECODING_STEPS=4, threshold=0.3)

    gen = out[prompt.shape[1]:]
    seq = prompt[0].clone()
    greedy = []
    for _ in range(len(gen)):
        nxt = ref_full_logits(model, seq).argmax().item()
        greedy.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
        if nxt == token_eos:
            break
    assert gen == greedy, (gen, greedy)

    worst = 0.0
    for toks, lg in DRAFT_LOG:
        worst = max(worst, (ref_draft_logits(model, toks, EARLY) - lg).abs().max().item())
    assert worst < 1e-4, worst
    assert max(accept[1:]) > 1, accept
    print(f"ok: {len(gen)} tokens equal greedy; {len(DRAFT_LOG)} draft logits match (max err {worst:.2e}); accept {accept}")
    sys.exit(0)
