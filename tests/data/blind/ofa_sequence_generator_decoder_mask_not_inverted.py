"""OFA (transformers port) beam search: decoder self-attention mask passed as `tokens.eq(pad)`.

Citation: OFA-Sys/OFA commit b3f1e6a ("invert mask for the latest PRs", on the
public branch feature/add_transformers that holds the transformers port), the
follow-up of OFA-Sys/OFA#254 (merge 134ad29), which switched `modeling_ofa.py`
to the Hugging Face mask convention (1 = attend, `_expand_mask` inverts).
Read in the upstream git history
(transformers/src/transformers/models/ofa/generate/sequence_generator.py).

Bug: after #254, `OFADecoder._prepare_decoder_attention_mask` expects
`attention_mask` with 1 = keep. The fairseq-style `SequenceGenerator`
(`EnsembleModel.forward_decoder`, used for beam search with incremental
states) still passed `attention_mask = tokens.eq(self.single_model.padding_idx)`
(True = pad). Every real decoder token became a masked key (finfo.min added to
every score), so each decode step's self-attention no longer depended on the
query-key scores. The sequence generator's own `_expand_mask` for the encoder
mask still used the old convention with `encoder_out.padding_mask`.

Fix: `attention_mask = ~tokens.eq(padding_idx)`; the generator's `_expand_mask`
also inverts and is called with `~encoder_out.padding_mask`.

This program: OFA's mask helpers, `OFAAttention` (bmm + additive mask +
softmax), a one-layer decoder with self/cross attention and a past-key-value
cache, and a small beam search (beam 2, batch 2 with a padded source) that
calls `EnsembleModel.forward_decoder` each step with the full token prefix,
as the upstream generator does.
"""
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

PAD, BOS = 1, 0


# ---- modeling_ofa.py (after #254) ----
def _make_causal_mask(input_ids_shape, dtype, past_key_values_length: int = 0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min)
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.ones(tgt_len, past_key_values_length, dtype=dtype), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len: Optional[int] = None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.bool(), torch.finfo(dtype).min)


class OFAAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, t, seq_len, bsz):
        return t.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        if key_value_states is not None:
            key_states = self._shape(self.k_proj(key_value_states), -1, bsz)
            value_states = self._shape(self.v_proj(key_value_states), -1, bsz)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
            if past_key_value is not None:
                key_states = torch.cat([past_key_value[0], key_states], dim=2)
                value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states)
        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        return self.out_proj(attn_output.reshape(bsz, tgt_len, self.embed_dim)), past_key_value


class OFADecoder(nn.Module):
    def __init__(self, vocab, dim, heads):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.embed_positions = nn.Embedding(32, dim)
        self.self_attn = OFAAttention(dim, heads)
        self.encoder_attn = OFAAttention(dim, heads)
        self.output_projection = nn.Linear(dim, vocab, bias=False)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, dtype, past_key_values_length):
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, dtype, past_key_values_length=past_key_values_length)
        if attention_mask is not None:
            expanded_attn_mask = _expand_mask(attention_mask, dtype, tgt_len=input_shape[-1])
            combined_attention_mask = (
                expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask + combined_attention_mask
            )
        return combined_attention_mask

    def forward(self, input_ids, attention_mask, encoder_hidden_states, encoder_attention_mask,
                past_key_values=None, use_cache=True):
        positions = torch.arange(input_ids.size(1)).expand_as(input_ids)
        if past_key_values is not None and len(past_key_values) > 0:
            input_ids = input_ids[:, -1:]
            positions = positions[:, -1:]
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None and len(past_key_values) > 0 else 0
        attention_mask = self._prepare_decoder_attention_mask(attention_mask, input_ids.shape, x.dtype, past_key_values_length)
        past = past_key_values[0] if past_key_values else None
        h, present = self.self_attn(x, past_key_value=past, attention_mask=attention_mask)
        x = x + h
        encoder_attention_mask = encoder_attention_mask[:, :, -x.size(1):, :]
        h, _ = self.encoder_attn(x, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask)
        x = x + h
        return self.output_projection(x), (present,)


# ---- generate/sequence_generator.py ----
def _expand_mask_generator(mask, dtype, tgt_len: Optional[int] = None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    if FIXED:
        inverted_mask = 1.0 - expanded_mask
        return inverted_mask.masked_fill(inverted_mask.bool(), torch.finfo(dtype).min)
    return expanded_mask.masked_fill(expanded_mask.bool(), torch.finfo(dtype).min)


class EnsembleModel(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.single_model = model
        self.padding_idx = PAD

    def forward_decoder(self, tokens, encoder_out, incremental_state):
        encoder_hidden_states = encoder_out["last_hidden_state"]
        if FIXED:
            encoder_attention_mask = _expand_mask_generator(~encoder_out["padding_mask"], encoder_hidden_states.dtype,
                                                            tokens.shape[-1])
            attention_mask = ~tokens.eq(self.padding_idx)
        else:
            encoder_attention_mask = _expand_mask_generator(encoder_out["padding_mask"], encoder_hidden_states.dtype,
                                                            tokens.shape[-1])
            attention_mask = tokens.eq(self.padding_idx)
        logits, present = self.single_model(
            input_ids=tokens, attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask, past_key_values=incremental_state, use_cache=True,
        )
        return logits[:, -1, :].log_softmax(-1), present


def beam_search(model, encoder_out, bsz, beam_size, max_len):
    tokens = torch.full((bsz * beam_size, max_len + 1), PAD, dtype=torch.long)
    tokens[:, 0] = BOS
    scores = torch.zeros(bsz * beam_size)
    incremental_state = None
    for step in range(max_len):
        lprobs, incremental_state = model.forward_decoder(tokens[:, : step + 1], encoder_out, incremental_state)
        lprobs[:, PAD] = -float("inf")
        if step == 0:
            lprobs = lprobs.view(bsz, beam_size, -1)[:, :1]  # all beams are identical at step 0
        else:
            lprobs = lprobs.view(bsz, beam_size, -1)
        cand = (lprobs + scores.view(bsz, -1, 1)[:, : lprobs.size(1)]).view(bsz, -1)
        top_scores, top_idx = cand.topk(beam_size, dim=-1)
        vocab = lprobs.size(-1)
        beam_idx = (top_idx // vocab) + torch.arange(bsz).unsqueeze(1) * beam_size
        beam_idx = beam_idx.view(-1)
        tokens = tokens[beam_idx]
        tokens[:, step + 1] = (top_idx % vocab).view(-1)
        scores = top_scores.view(-1)
        incremental_state = tuple((k.index_select(0, beam_idx), v.index_select(0, beam_idx))
                                  for k, v in incremental_state)
    return tokens, scores


def main():
    torch.manual_seed(0)
    vocab, dim, heads, beam_size, bsz = 20, 32, 4, 2, 2
    model = EnsembleModel(OFADecoder(vocab, dim, heads)).eval()
    src_len = 6
    padding_mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])  # True = pad (fairseq style)
    enc = torch.randn(bsz, src_len, dim)
    encoder_out = {
        "last_hidden_state": enc.repeat_interleave(beam_size, 0),
        "padding_mask": padding_mask.repeat_interleave(beam_size, 0),
    }
    with torch.no_grad():
        tokens, scores = beam_search(model, encoder_out, bsz, beam_size, max_len=4)
    print("fixed" if FIXED else "buggy", "beams:", tokens[:, 1:].tolist(), "score sum:", round(scores.sum().item(), 4))


if __name__ == "__main__":
    main()
