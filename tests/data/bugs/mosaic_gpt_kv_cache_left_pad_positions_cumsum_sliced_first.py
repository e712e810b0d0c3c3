"""MosaicGPT (mosaicml/examples, examples/llm): position ids under left padding go wrong once a KV cache is used.

Citation: mosaicml/examples#257 ("Fix slicing for padding + cache"), on top of #243 (MosaicGPT as a
HuggingFace PreTrainedModel, positions shifted by the padding) and #244 (past_key_values).

The bug: MosaicGPT.forward shifts its learned position ids left by the number of pad tokens seen so far,
``pos = torch.clamp(pos - torch.cumsum((attention_mask == 0)[:, past_position:], dim=1), min=0)``.
The padding column is sliced to the new tokens *before* the cumsum, so on every cached decode step
(one new, real token) the count is 0: a left-padded row's new token gets position ``past_position``
instead of ``past_position - n_pad``, a jump away from the positions its prompt was prefilled with.

The fix: cumsum over the whole mask, then slice,
``pos - torch.cumsum((attention_mask == 0), dim=1)[:, past_position:]``.

Trimmed to the torch attention path (scaled_multihead_dot_product_attention with key_padding_mask and
is_causal), the standard GPTBlock, tiny sizes and random weights; greedy decoding over a left-padded
batch, as MosaicGPT's prepare_inputs_for_generation feeds it (last token + full attention_mask).
"""

import math
import sys
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel

FIXED = "--fixed" in sys.argv


class MosaicGPTConfig(PretrainedConfig):
    model_type = "mosaic_gpt"

    def __init__(self, d_model=64, n_heads=4, n_layers=2, mlp_ratio=4, max_seq_len=32, vocab_size=50,
                 attn_pdrop=0.0, resid_pdrop=0.0, emb_pdrop=0.0, attn_impl="torch", **kwargs):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.mlp_ratio = mlp_ratio
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.attn_pdrop = attn_pdrop
        self.resid_pdrop = resid_pdrop
        self.emb_pdrop = emb_pdrop
        self.attn_impl = attn_impl
        super().__init__(**kwargs)


def scaled_multihead_dot_product_attention(query, key, value, n_heads, softmax_scale=None, attn_bias=None,
                                           key_padding_mask=None, is_causal=False, dropout_p=0.0,
                                           training=False, needs_weights=False):
    b, s_q, _ = query.shape
    s_k = key.size(1)
    q = query.view(b, s_q, n_heads, -1).permute(0, 2, 1, 3)  # b h s d
    k = key.view(b, s_k, n_heads, -1).permute(0, 2, 3, 1)  # b h d s
    v = value.view(b, s_k, n_heads, -1).permute(0, 2, 1, 3)  # b h s d

    min_val = torch.finfo(q.dtype).min
    d = q.size(-1)
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)

    attn_weight = q.matmul(k) * softmax_scale

    if attn_bias is not None:
        attn_weight = attn_weight + attn_bias

    if key_padding_mask is not None:
        attn_weight = attn_weight.masked_fill(~key_padding_mask.view((b, 1, 1, s_k)), min_val)

    if is_causal:
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float16)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)

    attn_weight = torch.softmax(attn_weight, dim=-1)

    if dropout_p:
        attn_weight = torch.nn.functional.dropout(attn_weight, p=dropout_p, training=training, inplace=True)

    out = attn_weight.matmul(v)
    out = out.permute(0, 2, 1, 3).reshape(b, s_q, -1)  # b s (h d)

    if needs_weights:
        return out, attn_weight
    return out, None


class MultiheadAttention(nn.Module):

    def __init__(self, cfg: MosaicGPTConfig, device: Optional[str] = None):
        super().__init__()
        self.attn_impl = cfg.attn_impl
        self.d_model = cfg.d_model
        self.n_heads = cfg.n_heads
        self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.attn_dropout_p = cfg.attn_pdrop
        self.Wqkv = nn.Linear(self.d_model, 3 * self.d_model, device=device)
        self.attn_fn = scaled_multihead_dot_product_attention
        self.out_proj = nn.Linear(self.d_model, self.d_model, device=device)

    def forward(self, x, past_key_value=None, attn_bias=None, attention_mask=None, is_causal=True,
                needs_weights=False):
        qkv = self.Wqkv(x)
        query, key, value = qkv.chunk(3, dim=2)

        key_padding_mask = attention_mask

        if past_key_value is not None:
            if len(past_key_value) != 0:
                key = torch.cat([past_key_value[0], key], dim=1)
                value = torch.cat([past_key_value[1], value], dim=1)
            past_key_value = (key, value)

        if attn_bias is not None:
            attn_bias = attn_bias[:, :, -query.size(1):, -key.size(1):]

        context, attn_weights = self.attn_fn(
            query, key, value, self.n_heads,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            dropout_p=self.attn_dropout_p,
            training=self.training,
            needs_weights=needs_weights,
        )
        return self.out_proj(context), attn_weights, past_key_value


class GPTMLP(nn.Module):

    def __init__(self, cfg: MosaicGPTConfig, device: Optional[str] = None):
        super().__init__()
        self.mlp_up = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, device=device)
        self.mlp_act = nn.GELU(approximate="none")
        self.mlp_down = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, device=device)

    def forward(self, x):
        return self.mlp_down(self.mlp_act(self.mlp_up(x)))


class GPTBlock(nn.Module):

    def __init__(self, cfg: MosaicGPTConfig, device: Optional[str] = None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, device=device)
        self.attn = MultiheadAttention(cfg, device)
        self.ln_2 = nn.LayerNorm(cfg.d_model, device=device)
        self.mlp = GPTMLP(cfg, device)
        self.resid_attn_dropout = nn.Dropout(cfg.resid_pdrop)
        self.resid_mlp_dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, x, past_key_value=None, attn_bias=None, attention_mask=None, is_causal=True):
        a = self.ln_1(x)
        b, _, past_key_value = self.attn(a, past_key_value=past_key_value, attn_bias=attn_bias,
                                         attention_mask=attention_mask, is_causal=is_causal)
        x = x + self.resid_attn_dropout(b)
        m = self.ln_2(x)
        n = self.mlp(m)
        x = x + self.resid_mlp_dropout(n)
        return x, past_key_value


class MosaicGPT(PreTrainedModel):
    config_class = MosaicGPTConfig
    base_model_prefix = "model"

    def __init__(self, config: MosaicGPTConfig):
        super().__init__(config)
        self.alibi = False
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.d_model),
            "wpe": nn.Embedding(config.max_seq_len, config.d_model),
            "emb_drop": nn.Dropout(config.emb_pdrop),
            "blocks": nn.ModuleList([GPTBlock(config) for _ in range(config.n_layers)]),
            "ln_f": nn.LayerNorm(config.d_model),
        })
        self.is_causal = True

    def _init_weights(self, module):
        pass

    def forward(self, input_ids: torch.LongTensor,
                past_key_values: Optional[List[Tuple[torch.FloatTensor]]] = None,
                attention_mask: Optional[torch.ByteTensor] = None,
                use_cache: Optional[bool] = None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if attention_mask is not None:
            attention_mask = attention_mask.bool()

        S = input_ids.size(1)
        assert S <= self.config.max_seq_len, \
            f"Cannot forward input with seq_len={S}, this model only supports seq_len<={self.config.max_seq_len}"

        tok_emb = self.transformer.wte(input_ids)
        if self.alibi:
            x = tok_emb
        else:
            past_position = 0
            if past_key_values is not None:
                if len(past_key_values) != self.config.n_layers:
                    raise ValueError("past_key_values must provide a past_key_value for each attention layer")
                # get the key tensor whose spec should be (batch, seq, dim), and
                # collect the `seq`, so that the position embedding is shifted
                if len(past_key_values[0]) != 0:
                    past_position = past_key_values[0][0].size(1)

            if S + past_position > self.config.max_seq_len:
                raise ValueError(f"Cannot forward input with past sequence length {past_position} and current "
                                 f"sequence length {S + 1}, this model only supports total sequence length <= "
                                 f"{self.config.max_seq_len}.")
            pos = torch.arange(past_position, S + past_position, dtype=torch.long,
                               device=input_ids.device).unsqueeze(0)
            if attention_mask is not None:
                # adjust the position indices to account for padding tokens
                if FIXED:
                    pos = torch.clamp(pos - torch.cumsum((attention_mask == 0), dim=1)[:, past_position:], min=0)
                else:
                    pos = torch.clamp(pos - torch.cumsum((attention_mask == 0)[:, past_position:], dim=1), min=0)

            pos_emb = self.transformer.wpe(pos)
            x = tok_emb + pos_emb

        x = self.transformer.emb_drop(x)

        if use_cache and past_key_values is None:
            past_key_values = [() for _ in range(self.config.n_layers)]

        for b_idx, block in enumerate(self.transformer.blocks):
            past_key_value = past_key_values[b_idx] if past_key_values is not None else None
            x, past_key_value = block(x, past_key_value=past_key_value, attn_bias=None,
                                      attention_mask=attention_mask, is_causal=self.is_causal)
            if past_key_values is not None:
                past_key_values[b_idx] = past_key_value

        x = self.transformer.ln_f(x)
        logits = F.linear(x, self.transformer.wte.weight)
        return logits, past_key_values

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, inputs_embeds=None, **kwargs):
        attention_mask = kwargs["attention_mask"].bool()
        if attention_mask[:, -1].sum() != attention_mask.shape[0]:
            raise NotImplementedError("MosaicGPT does not support generation with right padding.")
        if past_key_values is not None:
            input_ids = input_ids[:, -1].unsqueeze(-1)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "use_cache": kwargs.get("use_cache", True),
        }


@torch.no_grad()
def greedy_generate(model, input_ids, attention_mask, max_new_tokens):
    past_key_values = None
    step_logits = []
    for _ in range(max_new_tokens):
        inputs = model.prepare_inputs_for_generation(input_ids, past_key_values=past_key_values,
                                                     attention_mask=attention_mask, use_cache=True)
        logits, past_key_values = model(**inputs)
        next_logits = logits[:, -1, :]
        step_logits.append(next_logits)
        next_token = next_logits.argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.size(0), 1)], dim=1)
    return input_ids, torch.stack(step_logits, dim=1)


def main():
    torch.manual_seed(0)
    config = MosaicGPTConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=50)
    model = MosaicGPT(config).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)

    pad_token_id = 0
    prompts = [[5, 17, 23, 8, 41, 12], [9, 30, 4]]
    max_len = max(len(p) for p in prompts)
    # left padding, as MosaicGPT requires for generation
    input_ids = torch.tensor([[pad_token_id] * (max_len - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])

    out_ids, step_logits = greedy_generate(model, input_ids, attention_mask, max_new_tokens=6)
    for row, p in enumerate(prompts):
        print(f"row {row}: prompt {p} -> generated {out_ids[row, max_len:].tolist()}")
    print("last-step logits[:, :4]:", step_logits[:, -1, :4])


if __name__ == "__main__":
    main()
