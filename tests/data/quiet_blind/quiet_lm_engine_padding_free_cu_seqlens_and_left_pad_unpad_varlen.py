# Correct program (quiet batch quiet-r79a).
# Ported from IBM/dolomite-engine (lm_engine) @d0ee186128e8b8dfff7c1f90390398fdabc75be7:
#   lm_engine/data/utils.py (collate_fn: padding-free lists, or left padding with eos + attention_mask),
#   lm_engine/hf_models/utils.py (convert_padding_free_lists_to_tensors: cu_seqlens, max_seqlen, position_ids),
#   lm_engine/hf_models/modeling_utils/sequence_mixer_blocks/flash_attention_utils.py (unpad_input, flash_attention),
#   .../sequence_mixer_blocks/packing.py (compute_cu_seqlens_and_max_seqlen_from_attention_mask, pack_sequence /
#   unpack_sequence, cute_kernels' default padding_side="left"), .../softmax_attention.py (Attention, GQA split,
#   flash branch), lm_engine/hf_models/mixins/dense/base.py (_get_position_ids, _get_rope_cos_sin).
# Two ways into the same flash-attn varlen call: (a) the padding-free transformer, whose collator flattens the
# examples and hands cu_seqlens / max_seqlen / per-example position_ids to every layer; (b) the padded path, whose
# collator left-pads with eos and whose flash_attention() unpads q/k/v with cu_seqlens from attention_mask.sum(-1)
# (pack_sequence with padding_side="left") and unpacks the output back to (B, S, H, D). flash_attn_varlen_func /
# flash_attn_func are replaced by plain-torch stand-ins with flash's semantics (per cu_seqlens segment, causal
# aligned bottom-right). The self-check runs every example alone, unpadded, through the SDPA branch (is_causal=True)
# and compares every real token's hidden state with both batched paths.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ---------------------------------------------------------------- flash-attn stand-ins (CPU)
def flash_attention_2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                             softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    # q: (total_q, Hq, D), k / v: (total_k, Hkv, D); one attention per cu_seqlens segment
    out = torch.empty_like(q)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    groups = q.shape[1] // k.shape[1]
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
        vi = v[ks:ke].repeat_interleave(groups, dim=1).transpose(0, 1)
        lq, lk = qe - qs, ke - ks
        scores = (qi @ ki.transpose(-1, -2)) * softmax_scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        row = torch.arange(lq).unsqueeze(1) + (lk - lq)
        col = torch.arange(lk).unsqueeze(0)
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            keep &= col <= row
        if window_size[0] >= 0:
            keep &= col >= row - window_size[0]
        if window_size[1] >= 0:
            keep &= col <= row + window_size[1]
        scores = scores.masked_fill(~keep, float("-inf"))
        out[qs:qe] = (scores.softmax(-1) @ vi).transpose(0, 1)
    return out


def flash_attention_2(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    B, S = q.shape[:2]
    Sk = k.shape[1]
    cu_q = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    cu_k = torch.arange(0, (B + 1) * Sk, Sk, dtype=torch.int32)
    o = flash_attention_2_varlen(q.reshape(B * S, *q.shape[2:]), k.reshape(B * Sk, *k.shape[2:]),
                                 v.reshape(B * Sk, *v.shape[2:]), cu_q, cu_k, S, Sk, dropout_p, softmax_scale,
                                 causal, window_size, softcap)
    return o.view(B, S, *q.shape[2:])


# ---------------------------------------------------------------- packing.py
def compute_cu_seqlens_and_max_seqlen_from_attention_mask(attention_mask):
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = seqlens.max().item()
    return cu_seqlens, max_seqlen


def pack_sequence(inputs, cu_seqlens, padding_side="left"):
    # torch backend of cute_kernels' pack_sequence: keep each row's real tokens (at the right end for left padding)
    is_list = isinstance(inputs, (list, tuple))
    if not is_list:
        inputs = [inputs]
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    outputs = []
    for x in inputs:
        S = x.shape[1]
        rows = [x[b, S - n:] if padding_side == "left" else x[b, :n] for b, n in enumerate(seqlens)]
        outputs.append(torch.cat(rows, dim=0))
    return outputs if is_list else outputs[0]


def unpack_sequence(inputs, cu_seqlens, desired_shape, padding_side="left"):
    out = inputs.new_zeros(desired_shape)
    S = desired_shape[1]
    for b in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        n = e - s
        if padding_side == "left":
            out[b, S - n:] = inputs[s:e]
        else:
            out[b, :n] = inputs[s:e]
    return out


# ---------------------------------------------------------------- flash_attention_utils.py
def unpad_input(query, key, value, attention_mask, query_length):
    cu_seqlens_k, max_seqlen_k = compute_cu_seqlens_and_max_seqlen_from_attention_mask(attention_mask)
    batch_size, kv_seq_len = key.size()[:2]

    if query_length == kv_seq_len:
        query, key, value = pack_sequence(inputs=(query, key, value), cu_seqlens=cu_seqlens_k)
        cu_seqlens_q = cu_seqlens_k
        max_seqlen_q = max_seqlen_k
    else:
        key, value = pack_sequence(inputs=(key, value), cu_seqlens=cu_seqlens_k)
        if query_length == 1:
            cu_seqlens_q = torch.arange(batch_size + 1, dtype=torch.int32, device=query.device)
            query = query.squeeze(1)
            max_seqlen_q = 1
        else:
            # The -q_len: slice assumes left padding.
            attention_mask = attention_mask[:, -query_length:]
            cu_seqlens_q, max_seqlen_q = compute_cu_seqlens_and_max_seqlen_from_attention_mask(attention_mask)
            query = pack_sequence(inputs=query, cu_seqlens=cu_seqlens_q)

    return query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k


def flash_attention(query, key, value, attention_mask, cu_seqlens, max_seqlen, use_padding_free_transformer, causal,
                    dropout=0, softmax_scale=None, sliding_window=None, softcap=0):
    window_size = (-1, -1)
    if sliding_window is not None and key.size(1) > sliding_window:
        window_size = (sliding_window, sliding_window)

    if use_padding_free_transformer:
        attn_output = flash_attention_2_varlen(
            q=query, k=key, v=value, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen, dropout_p=dropout, softmax_scale=softmax_scale, causal=causal)
    else:
        if attention_mask is None:
            attn_output = flash_attention_2(q=query, k=key, v=value, dropout_p=dropout, softmax_scale=softmax_scale,
                                            causal=causal, window_size=window_size, softcap=softcap)
        else:
            batch_size, query_length, num_heads, head_dim = query.size()
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = unpad_input(
                query, key, value, attention_mask, query_length)
            attn_output = flash_attention_2_varlen(
                q=query, k=key, v=value, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout,
                softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
            attn_output = unpack_sequence(inputs=attn_output, cu_seqlens=cu_seqlens_q,
                                          desired_shape=(batch_size, query_length, num_heads, head_dim))
    return attn_output


# ---------------------------------------------------------------- rope
class RoPE(nn.Module):
    def __init__(self, head_dim, max_position_embeddings, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        t = torch.arange(max_position_embeddings).float()
        emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, seq_len, dtype):
        return self.cos_cached.to(dtype), self.sin_cached.to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x, cos_sin):
    cos, sin = cos_sin
    return x * cos + _rotate_half(x) * sin


# ---------------------------------------------------------------- softmax_attention.py (GQA)
class Attention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, num_key_value_heads, causal, layer_idx,
                 use_padding_free_transformer, use_flash):
        super().__init__()
        self.causal = causal
        self.hidden_size = hidden_size
        self.num_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.layer_idx = layer_idx
        self.use_padding_free_transformer = use_padding_free_transformer
        self.use_flash = use_flash
        self.c_attn = nn.Linear(hidden_size, hidden_size + 2 * num_key_value_heads * self.head_dim)
        self.c_proj = nn.Linear(hidden_size, hidden_size)

    def _prepare_qkv_for_forward_gqa(self, hidden_states):
        if self.use_padding_free_transformer:
            total_q = hidden_states.shape[0]
            input_shape = (hidden_states.shape[0], self.num_key_value_heads, -1)
            output_shape = (total_q, -1, self.head_dim)
        else:
            batch_size, query_length = hidden_states.shape[:-1]
            input_shape = (*hidden_states.shape[:-1], self.num_key_value_heads, -1)
            output_shape = (batch_size, query_length, -1, self.head_dim)

        hidden_states = hidden_states.view(*input_shape)
        query, key, value = hidden_states.split(
            ((self.num_heads // self.num_key_value_heads) * self.head_dim, self.head_dim, self.head_dim), dim=-1)
        query = query.reshape(*output_shape)

        if not self.use_padding_free_transformer:
            query = query.transpose(1, 2)
            key = key.transpose(1, 2)
            value = value.transpose(1, 2)
        return query, key, value

    def forward(self, hidden_states, attention_mask=None, rope_cos_sin=None, cu_seqlens=None, max_seqlen=None):
        query, key, value = self._prepare_qkv_for_forward_gqa(self.c_attn(hidden_states))
        query = apply_rotary_pos_emb(query, rope_cos_sin)
        key = apply_rotary_pos_emb(key, rope_cos_sin)

        if self.use_flash:
            if self.use_padding_free_transformer:
                output_shape = (-1, self.hidden_size)
            else:
                query = query.transpose(1, 2)
                key = key.transpose(1, 2)
                value = value.transpose(1, 2)
                batch_size, query_length = query.shape[:2]
                output_shape = (batch_size, query_length, -1)

            hidden_states = flash_attention(
                query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                attention_mask=attention_mask, use_padding_free_transformer=self.use_padding_free_transformer,
                causal=self.causal, dropout=0, softmax_scale=None)
            hidden_states = hidden_states.reshape(*output_shape)
        else:
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask,
                is_causal=self.causal if attention_mask is None else False, enable_gqa=True)
            batch_size = hidden_states.shape[0]
            hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.num_heads * self.head_dim)

        return self.c_proj(hidden_states)


class Block(nn.Module):
    def __init__(self, cfg, layer_idx, use_padding_free_transformer, use_flash):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg["hidden_size"])
        self.sequence_mixer = Attention(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                        True, layer_idx, use_padding_free_transformer, use_flash)
        self.ln_2 = nn.LayerNorm(cfg["hidden_size"])
        self.mlp_block = nn.Sequential(nn.Linear(cfg["hidden_size"], 4 * cfg["hidden_size"]), nn.GELU(),
                                       nn.Linear(4 * cfg["hidden_size"], cfg["hidden_size"]))

    def forward(self, hidden_states, attention_mask, rope_cos_sin, cu_seqlens, max_seqlen):
        hidden_states = hidden_states + self.sequence_mixer(self.ln_1(hidden_states), attention_mask=attention_mask,
                                                            rope_cos_sin=rope_cos_sin, cu_seqlens=cu_seqlens,
                                                            max_seqlen=max_seqlen)
        return hidden_states + self.mlp_block(self.ln_2(hidden_states))


class GPTBaseModel(nn.Module):
    def __init__(self, cfg, use_padding_free_transformer=False, use_flash=True):
        super().__init__()
        self.use_padding_free_transformer = use_padding_free_transformer
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.h = nn.ModuleList([Block(cfg, i, use_padding_free_transformer, use_flash)
                                for i in range(cfg["num_layers"])])
        self.ln_f = nn.LayerNorm(cfg["hidden_size"])
        self.rope = RoPE(cfg["hidden_size"] // cfg["num_attention_heads"], cfg["max_position_embeddings"])
        self.use_flash = use_flash

    def _get_position_ids(self, attention_mask, past_length, query_length, key_length, device):
        if attention_mask is not None and len(attention_mask.shape) == 2:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 0)
            if past_length > 0:
                position_ids = position_ids[:, past_length:key_length:]
        else:
            position_ids = torch.arange(past_length, key_length, dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0).view(-1, query_length)
        return position_ids

    def _get_rope_cos_sin(self, key_length, position_ids, dtype):
        cos, sin = self.rope(key_length, dtype=dtype)
        cos = cos[position_ids].unsqueeze(1)
        sin = sin[position_ids].unsqueeze(1)
        return cos, sin

    def forward(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, max_seqlen=None):
        if self.use_padding_free_transformer:
            key_length = max_seqlen.item() if isinstance(max_seqlen, torch.Tensor) else max_seqlen
            past_length = query_length = None
        else:
            past_length = 0
            query_length = input_ids.shape[-1]
            key_length = past_length + query_length
        if position_ids is None:
            position_ids = self._get_position_ids(attention_mask, past_length, query_length, key_length,
                                                  input_ids.device)
        hidden_states = self.wte(input_ids)
        rope_cos_sin = self._get_rope_cos_sin(key_length, position_ids, hidden_states.dtype)
        # flash: attention_mask stays (batch_size, key_length)
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask, rope_cos_sin, cu_seqlens, max_seqlen)
        return self.ln_f(hidden_states)


# ---------------------------------------------------------------- data/utils.py + hf_models/utils.py
def convert_padding_free_lists_to_tensors(input_ids, labels=None, device=None):
    seqlens = torch.tensor([0] + [len(x) for x in input_ids], device=device)
    cu_seqlens = seqlens.cumsum(dim=-1).to(torch.int32)
    max_seqlen = seqlens.max().item()
    position_ids = [list(range(len(x))) for x in input_ids]
    position_ids = torch.tensor([p for x in position_ids for p in x], device=device)
    input_ids = torch.tensor([t for x in input_ids for t in x], device=device)
    if labels is not None:
        labels = torch.tensor([t for x in labels for t in x], device=device)
    return input_ids, position_ids, None, labels, cu_seqlens, max_seqlen


def collate_fn(batch, eos_token_id, use_padding_free_transformer, labels_mask_value=-100, device="cpu"):
    inputs = [list(i["input"]) for i in batch]
    outputs = [list(i["output"]) for i in batch]
    if use_padding_free_transformer:
        labels = [[labels_mask_value] * (len(a_in) - len(a_out)) + a_out for a_in, a_out in zip(inputs, outputs)]
        input_ids, position_ids, _, labels, cu_seqlens, max_seqlen = convert_padding_free_lists_to_tensors(
            input_ids=inputs, labels=labels, device=device)
        return {"input_ids": input_ids, "position_ids": position_ids, "cu_seqlens": cu_seqlens,
                "max_seqlen": max_seqlen, "labels": labels}
    max_length = max(list(map(len, inputs)))
    input_ids = [[eos_token_id] * (max_length - len(array)) + array for array in inputs]
    attention_mask = [[0] * (max_length - len(array)) + [1] * len(array) for array in inputs]
    labels = [[labels_mask_value] * (max_length - len(array)) + array for array in outputs]
    return {"input_ids": torch.tensor(input_ids, device=device),
            "attention_mask": torch.tensor(attention_mask, device=device),
            "labels": torch.tensor(labels, device=device)}


def main():
    cfg = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_layers=2,
               max_position_embeddings=64)
    eos_token_id = 0
    flash_pf = GPTBaseModel(cfg, use_padding_free_transformer=True, use_flash=True).eval()
    flash_padded = GPTBaseModel(cfg, use_padding_free_transformer=False, use_flash=True).eval()
    sdpa_ref = GPTBaseModel(cfg, use_padding_free_transformer=False, use_flash=False).eval()
    flash_padded.load_state_dict(flash_pf.state_dict())
    sdpa_ref.load_state_dict(flash_pf.state_dict())

    lengths = [5, 11, 2, 8]
    batch = []
    for n in lengths:
        seq = torch.randint(1, cfg["vocab_size"], (n,)).tolist()
        batch.append({"input": seq, "output": seq[n // 2:]})

    with torch.no_grad():
        pf = collate_fn(batch, eos_token_id, use_padding_free_transformer=True)
        out_pf = flash_pf(pf["input_ids"], position_ids=pf["position_ids"], cu_seqlens=pf["cu_seqlens"],
                          max_seqlen=pf["max_seqlen"])
        padded = collate_fn(batch, eos_token_id, use_padding_free_transformer=False)
        out_padded = flash_padded(padded["input_ids"], attention_mask=padded["attention_mask"])

        S = padded["input_ids"].shape[1]
        cu = pf["cu_seqlens"].tolist()
        for b, ex in enumerate(batch):
            alone = sdpa_ref(torch.tensor([ex["input"]]))[0]
            n = len(ex["input"])
            torch.testing.assert_close(out_pf[cu[b]:cu[b + 1]], alone, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out_padded[b, S - n:], alone, rtol=1e-4, atol=1e-5)
    print("padding-free and left-padded varlen outputs match each example run alone")


if __name__ == "__main__":
    main()
