"""transformers generate(): encoder-decoder models lose the encoder attention_mask in the decode steps.

Citation: huggingface/transformers#36018 ("[generate] Fix encoder decoder models attention mask",
merged; it fixes the regression from PR #35852; user report with t5-small in issue #36293, fixed
by commit 77aa9fc). The PR and issue threads were read (not the diff); the fixed lines are those of
the installed transformers ``GenerationMixin.prepare_inputs_for_generation``
(``encoder_attention_mask = attention_mask if self.config.is_encoder_decoder else None`` ...
``model_inputs["attention_mask"] = encoder_attention_mask``); the pre-fix form -- the same function
without those lines -- is reconstructed from the PR description ("the attention mask is lost for
encoder-decoder models ... we'd need to pass both attention masks").

Bug: after #35852 the generic ``prepare_inputs_for_generation`` treated ``attention_mask`` as the
decoder's mask for encoder-decoder models (``decoder_attention_mask`` key, from kwargs) and did
not forward the encoder mask, so every decode step called the model with ``attention_mask=None``:
the encoder outputs were computed with the mask (the issue's reporter verified that), but the
decoder's cross-attention attended the padded encoder positions.
Fix: ``model_inputs["attention_mask"] = encoder_attention_mask`` is forwarded as well.

Reproduction: a Chronos-style forecast call -- a batch of two series, the shorter one left-padded
(NaN -> ``pad_token_id``, ``attention_mask = ~isnan``) plus EOS, as ChronosTokenizer does -- runs
``generate`` (greedy, KV cache) on a tiny plain-torch T5-like model (random weights; SDPA with
additive masks, no relative position bias) whose sizes and special ids live in transformers' ``T5Config``. The short
series' logits are compared with those of the same series generated alone.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import T5Config

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _additive(mask_2d, dtype):
    # [bsz, src_len] (1 = keep) -> [bsz, 1, 1, src_len] additive bias
    return (1.0 - mask_2d[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class T5Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads, self.d_kv = config.num_heads, config.d_kv
        inner = self.n_heads * self.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)

    def _shape(self, x):
        return x.view(x.shape[0], -1, self.n_heads, self.d_kv).transpose(1, 2)

    def forward(self, hidden_states, key_value_states=None, mask=None, past=None, is_cross=False):
        q = self._shape(self.q(hidden_states))
        if is_cross and past is not None:
            k, v = past
        else:
            src = key_value_states if is_cross else hidden_states
            k, v = self._shape(self.k(src)), self._shape(self.v(src))
            if past is not None:
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(hidden_states.shape[0], -1, self.n_heads * self.d_kv)
        return self.o(out), (k, v)


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(64, config.d_model)
        self.enc_attn = T5Attention(config)
        self.dec_self_attn = T5Attention(config)
        self.dec_cross_attn = T5Attention(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def encoder(self, input_ids, attention_mask):
        # T5's relative position bias is left out: left padding must not shift the real tokens
        h = self.shared(input_ids)
        out, _ = self.enc_attn(h, mask=_additive(attention_mask, h.dtype))
        return h + out

    def forward(self, decoder_input_ids, encoder_outputs, attention_mask=None, decoder_attention_mask=None,
                past_key_values=None, cache_position=None):
        h = self.shared(decoder_input_ids) + self.pos(cache_position)[None]
        self_past, cross_past = past_key_values if past_key_values is not None else (None, None)
        # one new token per step: its self-attention over the cache needs no causal mask
        out, self_past = self.dec_self_attn(h, past=self_past)
        h = h + out
        cross_mask = _additive(attention_mask, h.dtype) if attention_mask is not None else None
        out, cross_past = self.dec_cross_attn(h, key_value_states=encoder_outputs, mask=cross_mask,
                                             past=cross_past, is_cross=True)
        h = h + out
        return self.lm_head(h), (self_past, cross_past)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      cache_position=None, **kwargs):
        model_inputs = {"cache_position": cache_position, "past_key_values": past_key_values}
        input_ids_key = "decoder_input_ids" if self.config.is_encoder_decoder else "input_ids"
        model_inputs[input_ids_key] = input_ids[:, cache_position] if past_key_values is not None else input_ids
        if FIXED:
            encoder_attention_mask = attention_mask if self.config.is_encoder_decoder else None
        attention_mask_key = "decoder_attention_mask" if self.config.is_encoder_decoder else "attention_mask"
        attention_mask = (
            kwargs.pop("decoder_attention_mask", None) if self.config.is_encoder_decoder else attention_mask
        )
        if attention_mask is not None:
            model_inputs[attention_mask_key] = attention_mask
        if FIXED and encoder_attention_mask is not None:
            model_inputs["attention_mask"] = encoder_attention_mask
        model_inputs["encoder_outputs"] = kwargs["encoder_outputs"]
        return model_inputs

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens=4):
        model_kwargs = {"attention_mask": attention_mask}
        model_kwargs["encoder_outputs"] = self.encoder(input_ids, attention_mask)
        ids = torch.full((input_ids.shape[0], 1), self.config.decoder_start_token_id)
        past, all_logits = None, []
        for step in range(max_new_tokens):
            cache_position = torch.tensor([step])
            model_inputs = self.prepare_inputs_for_generation(ids, past_key_values=past, cache_position=cache_position,
                                                              **model_kwargs)
            logits, past = self(**model_inputs)
            all_logits.append(logits[:, -1])
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids, torch.stack(all_logits, dim=1)


def chronos_input_transform(context, config, n_tokens=24):
    """ChronosTokenizer-style: mean scaling, uniform bins, NaN -> pad, append EOS."""
    attention_mask = ~torch.isnan(context)
    scale = torch.nansum(context.abs(), dim=-1) / attention_mask.sum(-1)
    scaled = context / scale[:, None]
    token_ids = (torch.bucketize(scaled, torch.linspace(-3, 3, n_tokens - 3)) + 3).clamp(3, n_tokens - 1)
    token_ids[~attention_mask] = config.pad_token_id
    token_ids = torch.cat([token_ids, torch.full((len(context), 1), config.eos_token_id)], dim=1)
    attention_mask = torch.cat([attention_mask, torch.ones(len(context), 1, dtype=torch.bool)], dim=1)
    return token_ids, attention_mask.long()


if __name__ == "__main__":
    config = T5Config(vocab_size=24, d_model=32, d_kv=8, num_heads=4, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0, is_encoder_decoder=True)
    model = T5ForConditionalGeneration(config).eval()
    long = torch.sin(torch.arange(10.0)) + 2.0
    short = torch.cos(torch.arange(5.0)) + 2.0
    # left-pad the shorter context with NaN, as ChronosPipeline.predict does for a list of series
    context = torch.stack([long, torch.cat([torch.full((5,), float("nan")), short])])
    input_ids, attention_mask = chronos_input_transform(context, config)
    _, batched = model.generate(input_ids, attention_mask)
    ids1, am1 = chronos_input_transform(short[None], config)
    _, alone = model.generate(ids1, am1)
    diff = (batched[1] - alone[0]).abs().max().item()
    print("fixed" if FIXED else "buggy", "short series logits, batched vs alone:", f"{diff:.4f}")
