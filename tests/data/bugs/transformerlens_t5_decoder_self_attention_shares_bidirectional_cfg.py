# TransformerLensOrg/TransformerLens#1681: the T5 config sets attention_dir="bidirectional" for the encoder, and the
# one cfg is shared by both stacks, so HookedEncoderDecoder's decoder self-attention was never causally masked.
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class HookedTransformerConfig:
    d_model: int = 32
    d_head: int = 8
    n_heads: int = 4
    d_mlp: int = 64
    d_vocab: int = 50
    n_layers: int = 2
    attention_dir: str = "causal"
    dtype: torch.dtype = torch.float32


class T5Attention(nn.Module):
    def __init__(self, cfg, attention_dir: Optional[str] = None):
        super().__init__()
        self.cfg = cfg
        # after the fix a block can override the direction the shared cfg gives
        self.attention_dir = attention_dir if attention_dir is not None else cfg.attention_dir
        self.W_Q = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.2)
        self.W_K = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.2)
        self.W_V = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.2)
        self.W_O = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_head, cfg.d_model) * 0.2)
        self.register_buffer("IGNORE", torch.tensor(-torch.inf))

    def apply_causal_mask(self, attn_scores, past_kv_pos_offset=0):
        query_ctx_length, key_ctx_length = attn_scores.size(-2), attn_scores.size(-1)
        final_mask = torch.tril(torch.ones(key_ctx_length, key_ctx_length, dtype=torch.bool))
        final_mask = final_mask[-query_ctx_length:, -key_ctx_length:]
        return torch.where(final_mask, attn_scores, self.IGNORE)

    def forward(self, query_input, key_input, value_input, additive_attention_mask=None, position_bias=None):
        q = torch.einsum("bpd,hdk->bphk", query_input, self.W_Q)
        k = torch.einsum("bpd,hdk->bphk", key_input, self.W_K)
        v = torch.einsum("bpd,hdk->bphk", value_input, self.W_V)
        attn_scores = torch.einsum("bqhk,bphk->bhqp", q, k)  # T5: use_attn_scale=False
        if position_bias is not None:
            attn_scores = attn_scores + position_bias
        if self.attention_dir == "causal":
            # If causal attention, we mask it to only attend backwards. If bidirectional, we don't mask.
            attn_scores = self.apply_causal_mask(attn_scores)
        if additive_attention_mask is not None:
            attn_scores = attn_scores + additive_attention_mask
        pattern = F.softmax(attn_scores, dim=-1)
        pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
        z = torch.einsum("bhqp,bphk->bqhk", pattern, v)
        return torch.einsum("bqhk,hkd->bqd", z, self.W_O)


class T5Block(nn.Module):
    def __init__(self, cfg, block_index, is_decoder):
        super().__init__()
        self.is_decoder = is_decoder
        self.ln1 = nn.RMSNorm(cfg.d_model)
        if is_decoder and FIXED:
            self.attn = T5Attention(cfg, attention_dir="causal")
        else:
            self.attn = T5Attention(cfg)
        if is_decoder:
            self.ln2 = nn.RMSNorm(cfg.d_model)
            self.cross_attn = T5Attention(cfg)
        self.ln3 = nn.RMSNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_mlp, bias=False), nn.ReLU(),
                                 nn.Linear(cfg.d_mlp, cfg.d_model, bias=False))

    def forward(self, resid_pre, additive_attention_mask=None, encoder_additive_attention_mask=None,
                encoder_hidden_states=None):
        x = self.ln1(resid_pre)
        resid_mid = resid_pre + self.attn(query_input=x, key_input=x, value_input=x,
                                          additive_attention_mask=additive_attention_mask)
        if self.is_decoder:
            resid_mid = resid_mid + self.cross_attn(query_input=self.ln2(resid_mid),
                                                    key_input=encoder_hidden_states,
                                                    value_input=encoder_hidden_states,
                                                    additive_attention_mask=encoder_additive_attention_mask)
        return resid_mid + self.mlp(self.ln3(resid_mid))


class HookedEncoderDecoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.encoder = nn.ModuleList([T5Block(cfg, i, is_decoder=False) for i in range(cfg.n_layers)])
        self.encoder_final_ln = nn.RMSNorm(cfg.d_model)
        self.decoder = nn.ModuleList([T5Block(cfg, i, is_decoder=True) for i in range(cfg.n_layers)])
        self.decoder_final_ln = nn.RMSNorm(cfg.d_model)

    def forward(self, tokens, decoder_input, one_zero_attention_mask=None):
        resid = self.embed(tokens)
        additive_attention_mask = None
        if one_zero_attention_mask is not None:
            additive_attention_mask = (1 - one_zero_attention_mask)[:, None, None, :] * torch.finfo(self.cfg.dtype).min
        for encoder_block in self.encoder:
            resid = encoder_block(resid, additive_attention_mask=additive_attention_mask)
        encoder_resid = self.encoder_final_ln(resid)
        decoder_resid = self.embed(decoder_input)
        for decoder_block in self.decoder:
            decoder_resid = decoder_block(decoder_resid, encoder_hidden_states=encoder_resid,
                                          encoder_additive_attention_mask=additive_attention_mask)
        decoder_resid = self.decoder_final_ln(decoder_resid) * (self.cfg.d_model ** -0.5)
        return decoder_resid @ self.embed.weight.t()


# convert_hf_model_config for "T5ForConditionalGeneration"
cfg = HookedTransformerConfig(attention_dir="bidirectional")
model = HookedEncoderDecoder(cfg).eval()

tokens = torch.randint(1, cfg.d_vocab, (2, 7))
one_zero_attention_mask = torch.ones(2, 7)
one_zero_attention_mask[1, 5:] = 0
decoder_input = torch.randint(1, cfg.d_vocab, (2, 5))
decoder_input[:, 0] = 0  # decoder_start_token_id

with torch.no_grad():
    logits = model(tokens, decoder_input, one_zero_attention_mask)
    changed = decoder_input.clone()
    changed[:, -1] = (changed[:, -1] + 7) % cfg.d_vocab
    logits_changed = model(tokens, changed, one_zero_attention_mask)

# teacher forcing: position 0 must not depend on the last decoder token
print(f"fixed={FIXED} max |d logits[:, 0]| after changing the last decoder token: "
      f"{(logits[:, 0] - logits_changed[:, 0]).abs().max().item():.5f}")
