"""dolomite-engine GPTMegatron, SDPA: at decode the new token is handed is_causal=True with no mask.

Citation: ibm-granite/dolomite-engine#63 ("Hotfix for broken masks", commit 3aaba78; the SDPA path
came in with #59 "use sdpa hf mask"). Ported from dolomite_engine/hf_models/models/gpt_megatron/
base.py (GPTMegatronModel._prepare_a_bunch_of_stuff, _prepare_causal_attention_mask, _get_position_ids,
_get_mask_value), gpt_megatron/layer.py (GPTMegatronBlock), gpt_megatron/mlp.py (MLP),
modeling_utils/attention/base.py + sdpa.py (Attention, SDPA) and config.py (MegatronConfig), mha
heads, learned absolute positions; the HF generate loop (cache + growing attention_mask) is written
out by hand.

Bug: the SDPA path builds its mask with transformers' `_prepare_4d_causal_attention_mask_for_sdpa`,
which returns None when the 2D mask is all ones and `query_length == 1` (HF models then only set
`is_causal` when q_len > 1). The SDPA module calls `F.scaled_dot_product_attention(...,
attn_mask=attention_mask, is_causal=self.causal if attention_mask is None else False)`, so during
cached generation of an unpadded batch each new token (one query over past + 1 keys) gets SDPA's
top-left causal mask and attends to the first prompt token only.

Fix: for SDPA, when an attention_mask is given, build the (batch, 1, q, k) bool mask itself
(`_prepare_causal_attention_mask(attention_mask, batch_size, query_length, key_length, device)`,
bottom-right causal over the cached keys, and'ed with the padding mask) and turn it into an additive
mask with `torch.where(mask, ~mask, mask_value)`.
"""
import math
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig
from transformers.modeling_attn_mask_utils import (
    _prepare_4d_causal_attention_mask,
    _prepare_4d_causal_attention_mask_for_sdpa,
)

warnings.filterwarnings("ignore", category=FutureWarning)

FIXED = "--fixed" in sys.argv


class MegatronConfig(PretrainedConfig):
    model_type = "gpt_megatron"

    def __init__(self, vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                 num_key_value_heads=None, n_inner=None, activation_function="gelu_pytorch_tanh",
                 attention_head_type="mha", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                 layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
                 attention_multiplier=None, use_cache=True, add_bias=True,
                 position_embedding_type="learned_absolute", m_emb=None, m_residual=None, **kwargs):
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.n_embd = n_embd
        self.n_layer = n_layer
        self.n_head = n_head
        self.num_key_value_heads = n_head if num_key_value_heads is None else num_key_value_heads
        self.n_inner = 4 * n_embd if n_inner is None else n_inner
        self.activation_function = activation_function
        self.attention_head_type = attention_head_type
        self.resid_pdrop = resid_pdrop
        self.embd_pdrop = embd_pdrop
        self.attn_pdrop = attn_pdrop
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.scale_attn_weights = scale_attn_weights
        self.attention_multiplier = attention_multiplier
        self.use_cache = use_cache
        self.add_bias = add_bias
        self.position_embedding_type = position_embedding_type
        self.m_emb = m_emb
        self.m_residual = m_residual
        super().__init__(**kwargs)


class SDPA(nn.Module):
    def __init__(self, config: MegatronConfig, causal: bool, layer_idx: int = None) -> None:
        super().__init__()
        self.causal = causal
        self.hidden_size = config.n_embd
        self.num_heads = config.n_head
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.scale_attn_weights = config.scale_attn_weights
        self.attention_multiplier = config.attention_multiplier
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(self.hidden_size, self.hidden_size + 2 * self.num_key_value_heads * self.head_dim, bias=config.add_bias)
        self.c_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=config.add_bias)
        self.attn_pdrop = config.attn_pdrop
        self.resid_dropout = nn.Identity() if config.resid_pdrop == 0 else nn.Dropout(config.resid_pdrop)

    def _prepare_qkv_for_forward(self, hidden_states):
        hidden_states = self.c_attn(hidden_states)
        batch_size, query_length = hidden_states.shape[:-1]
        hidden_states = hidden_states.view(batch_size, query_length, self.num_heads, -1)
        hidden_states = hidden_states.transpose(1, 2)
        query, key, value = hidden_states.chunk(3, dim=-1)
        return query, key, value

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, rope_cos_sin=None,
                cu_seqlens=None, max_seqlen=None):
        query, key, value = self._prepare_qkv_for_forward(hidden_states)

        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        attn_output = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=self.attn_pdrop if self.training else 0,
            is_causal=self.causal if attention_mask is None else False,
            scale=self.attention_multiplier if self.scale_attn_weights else 1,
        )

        batch_size = attn_output.shape[0]
        attn_output = attn_output.transpose(1, 2)
        attn_output = attn_output.reshape(batch_size, -1, self.num_heads * self.head_dim)
        attn_output = self.c_proj(attn_output)
        return self.resid_dropout(attn_output)


class MLP(nn.Module):
    def __init__(self, config: MegatronConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.n_inner, bias=config.add_bias)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(config.n_inner, config.n_embd, bias=config.add_bias)
        self.dropout = nn.Identity() if config.resid_pdrop == 0 else nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states):
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


class GPTMegatronBlock(nn.Module):
    def __init__(self, config: MegatronConfig, layer_idx: int = None) -> None:
        super().__init__()
        self.m_residual = config.m_residual
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = SDPA(config, True, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, rope_cos_sin=None,
                cu_seqlens=None, max_seqlen=None):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output = self.attn(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask,
                                rope_cos_sin=rope_cos_sin, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if self.m_residual is not None:
            attn_output = attn_output * self.m_residual
        hidden_states = attn_output + residual
        residual = hidden_states
        hidden_states = self.ln_2(hidden_states)
        feed_forward_hidden_states = self.mlp(hidden_states)
        if self.m_residual is not None:
            feed_forward_hidden_states = feed_forward_hidden_states * self.m_residual
        return residual + feed_forward_hidden_states


class GPTMegatronModel(nn.Module):
    mask_value = None

    def __init__(self, config: MegatronConfig, attention_implementation: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self._use_sdpa = attention_implementation == "sdpa"
        self._use_flash_attention_2 = attention_implementation == "flash_attention_2"
        self._use_padding_free_transformer = False
        self.embed_dim = config.n_embd
        self.m_emb = config.m_emb
        self.wte = nn.Embedding(config.vocab_size, self.embed_dim)
        self.wpe = nn.Embedding(config.n_positions, self.embed_dim)
        self.drop = nn.Identity() if config.embd_pdrop == 0 else nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList([GPTMegatronBlock(config, layer_idx=i) for i in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=config.initializer_range * 10)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, use_cache=None):
        hidden_states, attention_mask, past_key_values = self._prepare_a_bunch_of_stuff(
            input_ids=input_ids, past_key_values=past_key_values, attention_mask=attention_mask
        )
        past_key_values = DynamicCache() if use_cache and past_key_values is None else past_key_values
        for block in self.h:
            hidden_states = block(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask)
        hidden_states = self.ln_f(hidden_states)
        return hidden_states, past_key_values

    def _get_position_ids(self, attention_mask, past_length, query_length, key_length, device):
        if attention_mask is not None and len(attention_mask.shape) == 2:
            # create position_ids on the fly for batch generation
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 0)
            if past_length > 0:
                position_ids = position_ids[:, past_length:key_length:]
        else:
            position_ids = torch.arange(past_length, key_length, dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0).view(-1, query_length)
        return position_ids

    def _prepare_causal_attention_mask_before_fix(self, attention_mask, inputs_embeds, past_length):
        batch_size, query_length = inputs_embeds.shape[:2]
        device = inputs_embeds.device

        # prepare causal mask only if not using flash attention
        if self._use_flash_attention_2:
            if attention_mask is None:
                attention_mask = torch.ones(batch_size, query_length, device=device)
        elif self._use_padding_free_transformer:
            attention_mask = None
        elif self._use_sdpa:
            attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
                attention_mask=attention_mask,
                input_shape=(batch_size, query_length),
                inputs_embeds=inputs_embeds,
                past_key_values_length=past_length,
                sliding_window=None,
            )
        else:
            attention_mask = _prepare_4d_causal_attention_mask(
                attention_mask=attention_mask,
                input_shape=(batch_size, query_length),
                inputs_embeds=inputs_embeds,
                past_key_values_length=past_length,
                sliding_window=None,
            )
        return attention_mask

    def _prepare_causal_attention_mask(self, attention_mask, batch_size, query_length, key_length, device):
        past_length = key_length - query_length

        if query_length > 1:
            # (query_length, key_length)
            causal_mask = torch.empty((query_length, key_length), dtype=torch.bool, device=device)
            causal_mask[:, past_length:] = torch.tril(
                torch.ones(query_length, query_length, dtype=torch.bool, device=device)
            )
            if past_length > 0:
                causal_mask[:, :past_length] = True

            causal_mask = causal_mask.unsqueeze(0)
            if attention_mask is None:
                causal_mask = causal_mask.expand(batch_size, -1, -1)
            else:
                causal_mask = causal_mask & attention_mask.unsqueeze(1).to(torch.bool)
        else:
            if attention_mask is None:
                causal_mask = torch.ones(batch_size, query_length, key_length, dtype=torch.bool, device=device)
            else:
                causal_mask = attention_mask.unsqueeze(1).to(dtype=torch.bool, device=device)

        # (batch_size, 1, query_length, key_length)
        return causal_mask.unsqueeze(1)

    def _get_mask_value(self, device, dtype):
        # torch.where expects a tensor. We use a cache to avoid recreating it every time.
        if self.mask_value is None or self.mask_value.dtype != dtype or self.mask_value.device != device:
            self.mask_value = torch.full([], torch.finfo(torch.float16).min, dtype=dtype, device=device)
        return self.mask_value

    def _prepare_a_bunch_of_stuff(self, input_ids, past_key_values=None, attention_mask=None):
        input_shape = input_ids.size()
        batch_size = input_shape[0]
        device = input_ids.device

        past_length = 0 if past_key_values is None else past_key_values.get_seq_length()
        query_length = input_shape[-1]
        key_length = past_length + query_length

        position_ids = self._get_position_ids(attention_mask, past_length, query_length, key_length, device)

        inputs_embeds = self.wte(input_ids) + self.wpe(position_ids)
        hidden_states = self.drop(inputs_embeds)
        if self.m_emb is not None:
            hidden_states = hidden_states * self.m_emb

        alibi_bias = None  # learned_absolute positions: no alibi

        if not FIXED:
            attention_mask = self._prepare_causal_attention_mask_before_fix(attention_mask, hidden_states, past_length)
            if alibi_bias is not None:
                attention_mask = attention_mask + alibi_bias
        elif self._use_flash_attention_2:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
        elif self._use_sdpa:
            # we use the causal/non-causal argument of SDPA for attention in this case
            if attention_mask is not None:
                attention_mask = self._prepare_causal_attention_mask(
                    attention_mask, batch_size, query_length, key_length, device
                )
                attention_mask = torch.where(
                    attention_mask,
                    ~attention_mask if alibi_bias is None else alibi_bias,
                    self._get_mask_value(attention_mask.device, hidden_states.dtype),
                )
        else:
            attention_mask = self._prepare_causal_attention_mask(
                attention_mask, batch_size, query_length, key_length, device
            )
            attention_mask = torch.where(
                attention_mask,
                ~attention_mask if alibi_bias is None else alibi_bias,
                self._get_mask_value(attention_mask.device, hidden_states.dtype),
            )

        return hidden_states, attention_mask, past_key_values


class GPTMegatronForCausalLM(nn.Module):
    def __init__(self, config: MegatronConfig, attention_implementation: str = "sdpa") -> None:
        super().__init__()
        self.transformer = GPTMegatronModel(config, attention_implementation)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True):
        hidden_states, past_key_values = self.transformer(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask, use_cache=use_cache
        )
        return self.lm_head(hidden_states), past_key_values


@torch.no_grad()
def greedy_generate(model, input_ids, attention_mask, max_new_tokens=6):
    """What `model.generate(input_ids=..., attention_mask=..., use_cache=True)` does, greedy."""
    past_key_values = None
    model_input = input_ids
    scores = []
    for _ in range(max_new_tokens):
        logits, past_key_values = model(model_input, past_key_values=past_key_values,
                                        attention_mask=attention_mask, use_cache=True)
        next_token_logits = logits[:, -1, :]
        scores.append(next_token_logits)
        next_tokens = next_token_logits.argmax(dim=-1)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        model_input = next_tokens[:, None]
    return input_ids, scores


def main():
    torch.manual_seed(0)
    config = MegatronConfig(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                            attention_head_type="mha", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = GPTMegatronForCausalLM(config, attention_implementation="sdpa").eval()

    batches = {
        "unpadded": (torch.tensor([[5, 17, 33, 8, 41, 12], [9, 22, 3, 50, 27, 14]]),
                     torch.ones(2, 6, dtype=torch.long)),
        "left-padded": (torch.tensor([[0, 0, 33, 8, 41, 12], [9, 22, 3, 50, 27, 14]]),
                        torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])),
    }
    for name, (input_ids, attention_mask) in batches.items():
        sequences, scores = greedy_generate(model, input_ids, attention_mask)
        print(name, "generated:", sequences[:, input_ids.shape[1]:].tolist())
        print(name, "step-2 scores[0, :4]:", [round(v, 4) for v in scores[1][0, :4].tolist()])


if __name__ == "__main__":
    main()
