# unslothai/unsloth#3034 (commit 8e994f07fb): "Fix Llama and Gemma inference"
# LlamaModel_fast_forward (shared by Gemma 2), eval path with a padded batch: attention_mask was already turned into
# a 4D additive SDPA mask (0 / finfo.min), then the Gemma 2 branch re-applied `(1.0 - mask) * finfo.min` to it (kept
# keys -> finfo.min, swamping the softcapped scores into uniform weights; masked keys -> -inf) and cut the dynamic SWA /
# global masks down to `[0][0]`, batch row 0's (q, k) mask, added to every row: a left-padded row attends pad keys.
# The fix drops the re-inversion and the `[0][0]`, so each row gets its own 4D causal + window + padding mask.
import sys

import torch
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM
from transformers.models.gemma2 import modeling_gemma2

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# transformers 4.5x modeling_attn_mask_utils._prepare_4d_causal_attention_mask_for_sdpa (what unsloth imported),
# CPU path (no _unmask_unattended)
def _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, input_shape, inputs_embeds, past_key_values_length,
                                               sliding_window=None):
    dtype = inputs_embeds.dtype
    min_dtype = torch.finfo(dtype).min
    bsz, query_length = input_shape
    key_value_length = query_length + past_key_values_length
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is not None and torch.all(attention_mask == 1):
        if (query_length == 1 or key_value_length == query_length) and \
                (sliding_window is None or key_value_length < sliding_window):
            return None
    # to_causal_4d
    i = torch.arange(query_length)[:, None] + past_key_values_length
    j = torch.arange(key_value_length)[None, :]
    masked = j > i
    if sliding_window is not None:
        masked = masked | (j <= i - sliding_window)
    causal = torch.zeros(query_length, key_value_length, dtype=dtype).masked_fill(masked, min_dtype)
    causal = causal[None, None].expand(bsz, 1, query_length, key_value_length)
    if attention_mask is None:
        return causal
    # _expand_mask + merge
    expanded = attention_mask[:, None, None, :].expand(bsz, 1, query_length, key_value_length).to(dtype)
    inverted = (1.0 - expanded).masked_fill((1.0 - expanded).bool(), min_dtype)
    return causal.masked_fill(inverted.bool(), min_dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


# unsloth/kernels/flex_attention.py (HAS_FLEX_ATTENTION = False)
def slow_inference_attention_softcapping(Q, K, V, causal_mask, self, bsz, q_len):
    n_heads = self.config.num_attention_heads
    head_dim = self.head_dim
    n_kv_heads = self.config.num_key_value_heads
    n_groups = self.num_key_value_groups
    K = K[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, q_len, head_dim)
    V = V[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, q_len, head_dim)
    K = K.reshape(bsz, n_heads, q_len, head_dim)
    V = V.reshape(bsz, n_heads, q_len, head_dim)
    s = self.config.query_pre_attn_scalar
    t = self.config.attn_logit_softcapping
    Q = Q * torch.tensor(s ** -0.5, dtype=Q.dtype)
    A = torch.matmul(Q, K.transpose(2, 3))
    A /= t; torch.tanh(A, out=A); A *= t
    A += causal_mask[:q_len, :q_len]
    A = F.softmax(A, dim=-1, dtype=torch.float32).to(Q.dtype)
    self._last_probs = A.detach()
    A = torch.matmul(A, V)
    A = A.transpose(1, 2).contiguous()
    return A.reshape(bsz, q_len, n_heads * head_dim)


# unsloth/models/gemma2.py Gemma2Attention_fast_forward (no flash-attn softcapping on this machine)
def Gemma2Attention_fast_forward(self, hidden_states, causal_mask=None, attention_mask=None, position_ids=None,
                                 position_embeddings=None, **kwargs):
    bsz, q_len, _ = hidden_states.size()
    n_heads = self.config.num_attention_heads
    n_kv_heads = self.config.num_key_value_heads
    head_dim = self.head_dim
    Q = self.q_proj(hidden_states).view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
    K = self.k_proj(hidden_states).view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    V = self.v_proj(hidden_states).view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    kv_seq_len = K.shape[-2]
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    Q = Q * cos + rotate_half(Q) * sin
    K = K * cos + rotate_half(K) * sin
    A = slow_inference_attention_softcapping(Q, K, V, causal_mask, self, bsz, kv_seq_len)
    return self.o_proj(A)


# unsloth/models/gemma2.py Gemma2DecoderLayer_fast_forward (non-cache branch)
def Gemma2DecoderLayer_fast_forward(self, hidden_states, causal_mask=None, attention_mask=None, position_ids=None,
                                    position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states = self.self_attn(hidden_states, causal_mask=causal_mask, attention_mask=attention_mask,
                                   position_ids=position_ids, position_embeddings=position_embeddings)
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.pre_feedforward_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = self.post_feedforward_layernorm(hidden_states)
    return residual + hidden_states


# unsloth/models/llama.py LlamaModel_fast_forward, the parts that decide the mask (IS_GEMMA2, eval, no KV cache yet)
def LlamaModel_fast_forward(self, input_ids=None, causal_mask=None, attention_mask=None, position_ids=None, **kwargs):
    batch_size, seq_length = input_ids.shape
    past_key_values_length = 0
    inputs_embeds = self.embed_tokens(input_ids)  # Gemma2TextScaledWordEmbedding multiplies by sqrt(hidden)

    # Ignore attention_mask
    if attention_mask is None:
        padding_mask = None
    elif self.training:
        attention_mask = None
        padding_mask = None
    else:
        padding_mask = None
        attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
            attention_mask,
            (batch_size, seq_length),
            inputs_embeds,
            past_key_values_length,
            sliding_window=getattr(self.config, "sliding_window", None),
        )
    hidden_states = inputs_embeds

    # Gemma2 has alternating SWA and global attn
    use_static_mask = True
    dynamic_SWA_mask = None
    dynamic_GA_mask = None
    if attention_mask is not None:
        # Fixes https://github.com/unslothai/unsloth/issues/853
        # Unsloth needs a 2D mask, not a [2, 1, n, n] mask!
        if not FIXED:
            # https://github.com/pytorch/pytorch/issues/103749
            # Need to convert to float and not using bool
            attention_mask = (1.0 - attention_mask.float()) * torch.finfo(inputs_embeds.dtype).min
        dynamic_SWA_mask = _prepare_4d_causal_attention_mask_for_sdpa(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length,
            sliding_window=self.config.sliding_window,
        )
        dynamic_GA_mask = _prepare_4d_causal_attention_mask_for_sdpa(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length,
            sliding_window=None,
        )
        if not FIXED:
            dynamic_SWA_mask = dynamic_SWA_mask[0][0]
            dynamic_GA_mask = dynamic_GA_mask[0][0]
        use_static_mask = False
    elif not hasattr(self, "SWA_mask"):
        n = seq_length
        self.SWA_mask = _prepare_4d_causal_attention_mask_for_sdpa(
            None, (1, n), inputs_embeds, 0, sliding_window=self.config.sliding_window)[0][0]
        self.GA_mask = _prepare_4d_causal_attention_mask_for_sdpa(None, (1, n), inputs_embeds, 0)[0][0]

    position_embeddings = self.rotary_emb(hidden_states, position_ids)
    for idx, decoder_layer in enumerate(self.layers):
        if idx % 2 == 0:
            mask = self.SWA_mask if use_static_mask else dynamic_SWA_mask
        else:
            mask = self.GA_mask if use_static_mask else dynamic_GA_mask
        hidden_states = decoder_layer(hidden_states, causal_mask=mask, attention_mask=attention_mask,
                                      position_ids=position_ids, position_embeddings=position_embeddings)
    return self.norm(hidden_states)


# FastGemma2Model.pre_patch
modeling_gemma2.Gemma2Attention.forward = Gemma2Attention_fast_forward
modeling_gemma2.Gemma2DecoderLayer.forward = Gemma2DecoderLayer_fast_forward
modeling_gemma2.Gemma2Model.forward = LlamaModel_fast_forward

config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                      query_pre_attn_scalar=8, pad_token_id=0)
model = Gemma2ForCausalLM(config).eval()  # FastLanguageModel.for_inference

# batched inference on left-padded prompts (tokenizer.padding_side = "left"), as generate's prefill sees them
prompts = [[5, 9, 12, 7, 30, 22, 41, 3], [17, 8, 44]]
L = max(len(p) for p in prompts)
input_ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
position_ids = attention_mask.long().cumsum(-1) - 1
position_ids.masked_fill_(attention_mask == 0, 1)

with torch.no_grad():
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    logits = model.lm_head(hidden[:, -1:, :])
    logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    probs1 = model.model.layers[1].self_attn._last_probs  # global layer

    # the short prompt alone, unpadded (shorter than the window: no mask, the static causal masks): the reference
    ids_b = torch.tensor([prompts[1]])
    pos_b = torch.arange(len(prompts[1]))[None]
    ref = model.model(input_ids=ids_b, attention_mask=torch.ones_like(ids_b), position_ids=pos_b)
    ref = model.lm_head(ref[:, -1:, :])
    ref = torch.tanh(ref / config.final_logit_softcapping) * config.final_logit_softcapping

print("fixed" if FIXED else "buggy")
print("row 1 (left-padded), last query, global-layer weights head 0:", [round(x, 3) for x in probs1[1, 0, -1].tolist()])
print("next token, batched:", logits.argmax(-1).flatten().tolist(),
      "| row 1 max |logit diff| vs unpadded:", round((logits[1] - ref[0]).abs().max().item(), 5))
