# unslothai/unsloth#4100 (commit 6d0f864369, "Fix/pr 3699 leftpad prefill main"), item 3:
# "granite.py: Apply attention_mask during decode inference for bsz > 1."
# Bug: GraniteModel_fast_forward_inference builds a 4-D SDPA mask for a batched (left-padded)
# decode step and passes it to GraniteAttention_fast_forward_inference, which computes
# Q @ K^T over the whole paged KV cache and softmaxes it with the mask line commented out
# ("# if attention_mask is not None: A += attention_mask # Must add attention_mask for batched").
# Fix: for bsz > 1 the mask is turned to bool (.eq(0)) and handed to scaled_dot_product_attention.
# Ported from unsloth/models/granite.py (before / after the fix); the prefill is transformers'
# GraniteForCausalLM, as unsloth's generate runs it. position_ids stay cache_position (shared
# by the batch) in both runs, as unsloth passed them before the same PR's llama.py change.
import sys
import math
import torch
import torch.nn.functional as F
from transformers import GraniteConfig, GraniteForCausalLM
from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask_for_sdpa

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

KV_CACHE_INCREMENT = 256
torch_nn_functional_softmax = torch.nn.functional.softmax
torch_matmul = torch.matmul
scaled_dot_product_attention = F.scaled_dot_product_attention
SDPA_HAS_GQA = True


def fast_linear_forward(proj, X, out=None):
    return F.linear(X, proj.weight, proj.bias)


def fast_rms_layernorm_inference(norm, X):
    return norm(X)


def fast_swiglu_inference(mlp, X):
    return mlp(X)


def GraniteAttention_fast_forward_inference(
    self, hidden_states, past_key_value, position_ids, do_prefill=False,
    attention_mask=None, use_sliding_window=False, position_embeddings=None,
):
    Xn = hidden_states
    bsz, _, hd = hidden_states.size()
    K1, V1 = past_key_value
    dtype = Xn.dtype

    n_heads = self.config.num_attention_heads
    n_groups = self.num_key_value_groups
    n_kv_heads = self.config.num_key_value_heads
    head_dim = self.head_dim
    hidden_size = self.config.hidden_size
    attention_size = n_heads * head_dim
    seq_len = K1.shape[-2]
    kv_seq_len = seq_len + 1
    device = hidden_states.device

    if do_prefill:
        self.paged_attention = torch.empty(
            (KV_CACHE_INCREMENT + seq_len + 1, 2, bsz, n_kv_heads, head_dim), dtype=dtype, device=device
        )
        self.paged_attention_K = self.paged_attention[:, 0]
        self.paged_attention_V = self.paged_attention[:, 1]
        self.paged_attention_K[:seq_len] = K1.permute(2, 0, 1, 3)
        self.paged_attention_V[:seq_len] = V1.permute(2, 0, 1, 3)
        self.RH_Q = torch.empty((bsz, n_heads, 1, head_dim), dtype=dtype, device=device)
        self.attention = torch.empty((bsz, n_heads, 1, KV_CACHE_INCREMENT + seq_len), dtype=dtype, device=device)
        self.half_head_dim = head_dim // 2

    Qn = fast_linear_forward(self.q_proj, Xn)
    Kn = fast_linear_forward(self.k_proj, Xn)
    Vn = fast_linear_forward(self.v_proj, Xn)
    Qn = Qn.view(bsz, 1, n_heads, head_dim).transpose(1, 2)
    Kn = Kn.view(bsz, 1, n_kv_heads, head_dim).transpose(1, 2)
    Vn = Vn.view(bsz, 1, n_kv_heads, head_dim).transpose(1, 2)

    cos, sin = position_embeddings
    cos, sin = cos[position_ids], sin[position_ids]
    h = self.half_head_dim

    RH_Q = self.RH_Q
    RH_Q[:, :, :, :h] = Qn[:, :, :, h:]
    RH_Q[:, :, :, h:] = Qn[:, :, :, :h]
    RH_Q[:, :, :, :h].neg_()
    Qn = Qn * cos
    Qn.addcmul_(RH_Q, sin)

    RH_K = RH_Q[:, :n_kv_heads, :, :]
    RH_K[:, :, :, :h] = Kn[:, :, :, h:]
    RH_K[:, :, :, h:] = Kn[:, :, :, :h]
    RH_K[:, :, :, :h].neg_()
    Kn = Kn * cos
    Kn.addcmul_(RH_K, sin)

    self.paged_attention_K[seq_len] = Kn.permute(2, 0, 1, 3)
    self.paged_attention_V[seq_len] = Vn.permute(2, 0, 1, 3)
    Kn = self.paged_attention_K[:kv_seq_len].permute(1, 2, 0, 3)
    Vn = self.paged_attention_V[:kv_seq_len].permute(1, 2, 0, 3)

    _, _, cached_len, _ = Kn.shape
    if not FIXED:
        if n_groups != 1:
            Kn = Kn[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, cached_len, head_dim)
            Vn = Vn[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, cached_len, head_dim)
            Kn = Kn.reshape(bsz, n_heads, cached_len, head_dim)
            Vn = Vn.reshape(bsz, n_heads, cached_len, head_dim)

        Qn *= self.scaling
        A = torch_matmul(Qn, Kn.transpose(2, 3))

        # if attention_mask is not None: A += attention_mask # Must add attention_mask for batched

        A = torch_nn_functional_softmax(A, dim=-1, dtype=torch.float32).to(Qn.dtype)
        A = torch_matmul(A, Vn)
    else:
        if bsz == 1 or ((not SDPA_HAS_GQA) and n_groups != 1):
            Kn = Kn[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, cached_len, head_dim)
            Vn = Vn[:, :, None, :, :].expand(bsz, n_kv_heads, n_groups, cached_len, head_dim)
            Kn = Kn.reshape(bsz, n_heads, cached_len, head_dim)
            Vn = Vn.reshape(bsz, n_heads, cached_len, head_dim)
        if bsz == 1:
            Qn *= self.scaling
            A = torch_matmul(Qn, Kn.transpose(2, 3))
            A = torch_nn_functional_softmax(A, dim=-1, dtype=torch.float32).to(Qn.dtype)
            A = torch_matmul(A, Vn)
        else:
            if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype != torch.bool:
                attention_mask = attention_mask.eq(0)
            A = scaled_dot_product_attention(
                Qn, Kn, Vn, attn_mask=attention_mask, scale=self.scaling, enable_gqa=True,
            )
    A = A.transpose(1, 2)
    A = A.reshape(bsz, 1, attention_size)
    A = fast_linear_forward(self.o_proj, A)
    return A, (Kn, Vn)


def GraniteModel_fast_forward_inference(self, input_ids, past_key_values, position_ids, attention_mask=None):
    hidden_states = self.model.embed_tokens(input_ids)
    hidden_states *= self.model.embedding_multiplier
    residual_multiplier = self.config.residual_multiplier

    bsz, q_len, hd = hidden_states.shape
    seq_len = past_key_values[0][0].shape[-2]
    if bsz != 1:
        attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
            attention_mask, (bsz, q_len), hidden_states, seq_len,
        )
        if FIXED and attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.eq(0)
    else:
        attention_mask = None

    position_embeddings = self.model._unsloth_cos_sin  # rotary_emb.get_cached(max_seq_length)

    next_decoder_cache = []
    for idx, decoder_layer in enumerate(self.model.layers):
        residual = hidden_states
        hidden_states = fast_rms_layernorm_inference(decoder_layer.input_layernorm, hidden_states)
        hidden_states, present_key_value = GraniteAttention_fast_forward_inference(
            decoder_layer.self_attn,
            hidden_states=hidden_states,
            past_key_value=past_key_values[idx],
            position_ids=position_ids,
            attention_mask=attention_mask,
            do_prefill=not hasattr(decoder_layer.self_attn, "paged_attention"),
            position_embeddings=position_embeddings,
        )
        hidden_states = torch.add(residual, hidden_states, alpha=residual_multiplier)
        residual = hidden_states
        hidden_states = fast_rms_layernorm_inference(decoder_layer.post_attention_layernorm, hidden_states)
        hidden_states = fast_swiglu_inference(decoder_layer.mlp, hidden_states)
        hidden_states = torch.add(residual, hidden_states, alpha=residual_multiplier)
        next_decoder_cache.append(present_key_value)
    hidden_states = self.model.norm(hidden_states)
    logits = self.lm_head(hidden_states) / self.config.logits_scaling
    return logits, next_decoder_cache


config = GraniteConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    pad_token_id=0, attn_implementation="sdpa",
)
model = GraniteForCausalLM(config).eval()
max_seq_length = 128
with torch.no_grad():
    cs_pos = torch.arange(max_seq_length)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), cs_pos)
    model.model._unsloth_cos_sin = (cos[0], sin[0])

# Left-padded batch, as unsloth's generate pads prompts.
prompts = [[5, 17, 33, 9, 41, 22, 7, 61], [12, 48, 3]]
L = max(len(p) for p in prompts)
input_ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])

generated = []
with torch.no_grad():
    cache_position = torch.arange(L)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=cache_position[None].expand(2, -1), use_cache=True)
    pkv = out.past_key_values
    past = [(layer.keys, layer.values) for layer in pkv.layers]
    next_tok = out.logits[:, -1].argmax(-1, keepdim=True)
    generated.append(next_tok)
    for step in range(6):
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=attention_mask.dtype)], dim=1)
        cache_position = cache_position[-1:] + 1
        position_ids = cache_position  # kwargs["position_ids"] = kwargs["cache_position"]
        logits, past = GraniteModel_fast_forward_inference(model, next_tok, past, position_ids, attention_mask)
        next_tok = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(next_tok)

gen = torch.cat(generated, dim=1)
print("generated:", gen.tolist())
print("last logits row 1:", logits[1, -1, :6].tolist())
