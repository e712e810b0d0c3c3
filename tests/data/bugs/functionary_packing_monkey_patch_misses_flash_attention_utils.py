# MeetKai/functionary commit 2b6d23e ("update monkey-patch for packing"): packing without cross-contamination.
# PackedDataset marks each packed data point in attention_mask with its own number (1, 1, 1, 2, 2, 0, ...) and
# monkey_patch_packing_for_model replaces `_get_unpad_data` so the flash-attention varlen path gets one cu_seqlens
# entry per data point. Before the fix it patched `transformers.models.llama.modeling_llama._get_unpad_data`, but
# transformers had moved the flash path into modeling_flash_attention_utils, whose `_upad_input` calls its own
# `_get_unpad_data`: the patch landed on a name nobody reads, the stock function took the packed mask as 0/1
# padding, and each row ran as one sequence (data point 2 attends to data point 1). The fix patches
# `transformers.modeling_flash_attention_utils._get_unpad_data`.
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
import transformers.modeling_flash_attention_utils  # noqa: F401  (the flash path of the models)
import transformers.models.llama.modeling_llama  # noqa: F401
from transformers import LlamaConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- functionary/train/packing/monkey_patch_packing.py ----
def get_max_seqlen_in_batch(attention_mask):
    max_num = torch.max(attention_mask)
    # attention_mask: B x N
    counts = []
    for i in range(1, max_num + 1):
        counts.append(
            torch.sum(attention_mask == i, axis=-1)
        )  # shape: B, count length of data point maksed with i
    result = torch.stack(counts, axis=1)
    result = result.flatten()
    return result[result.nonzero()].squeeze(-1).to(dtype=torch.int32)


def get_unpad_data(attention_mask):
    seqlens_in_batch = get_max_seqlen_in_batch(
        attention_mask
    )  # attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(
        torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.torch.int32), (1, 0)
    )
    return (
        indices,
        cu_seqlens,
        max_seqlen_in_batch,
    )


def monkey_patch_packing_for_model(model_config):
    config_type = type(model_config).__name__.lower()
    if FIXED:
        # Monkey-patch flash attention if this transformers already merged:
        # https://github.com/huggingface/transformers/commit/e314395277d784a34ee99526f48155d4d62cff3d
        if hasattr(transformers, "modeling_flash_attention_utils"):
            transformers.modeling_flash_attention_utils._get_unpad_data = get_unpad_data
            return
    if "mistral" in config_type:
        print("monkey_patch_packing for Mistral ")
        transformers.models.mistral.modeling_mistral._get_unpad_data = get_unpad_data
    elif "llama" in config_type:
        print("monkey_patch_packing for Llama ")
        transformers.models.llama.modeling_llama._get_unpad_data = get_unpad_data
    elif "qwen2" in config_type:
        print("monkey_patch_packing for Qwen2")
        transformers.models.qwen2.modeling_qwen2._get_unpad_data = get_unpad_data
    else:
        raise Exception(f"{config_type} is not supported")


# ---- functionary/train/packing/packed_dataset.py ----
def pack_data_points_FA(data_points, tokenizer, model_max_length):
    input_ids = []
    lengths = []
    label_ids = []
    attention_mask = []

    for index, item in enumerate(data_points):
        input_ids += item["input_ids"]
        labels = list(item["labels"])
        labels[0] = -100
        label_ids += labels
        lengths.append(len(item["input_ids"]))
        attention_mask += [index + 1 for _ in range(len(item["input_ids"]))]

    pad_leng = model_max_length - len(input_ids)  # padding to model_max_length

    if tokenizer.padding_side == "right":
        input_ids = input_ids + [tokenizer.pad_token_id for _ in range(pad_leng)]
        label_ids = label_ids + [-100 for _ in range(pad_leng)]
        attention_mask = attention_mask + [0 for _ in range(pad_leng)]
    else:
        input_ids = [tokenizer.pad_token_id for _ in range(pad_leng)] + input_ids
        label_ids = [-100 for _ in range(pad_leng)] + label_ids
        attention_mask = [0 for _ in range(pad_leng)] + attention_mask

    assert len(input_ids) == len(label_ids) == len(attention_mask) == model_max_length
    return {
        "input_ids": torch.tensor(input_ids),
        "labels": torch.tensor(label_ids),
        "attention_mask": torch.tensor(attention_mask),
    }


# ---- the flash-attention-2 path of a Llama model (transformers ~4.43), on CPU ----
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=True):
    # stands in for flash_attn's kernel: one causal attention per [cu_seqlens[i], cu_seqlens[i+1]) segment
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1), is_causal=causal
        )
        out[qs:qe] = o.transpose(0, 1)
    return out


def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, is_causal=True):
    fa_utils = transformers.modeling_flash_attention_utils
    if attention_mask is not None:
        batch_size = query_states.shape[0]
        query_states, key_states, value_states, indices_q, cu_seq_lens, max_seq_lens = fa_utils._upad_input(
            query_states, key_states, value_states, attention_mask, query_length, fa_utils._unpad_input
        )
        cu_seqlens_q, cu_seqlens_k = cu_seq_lens
        max_seqlen_in_batch_q, max_seqlen_in_batch_k = max_seq_lens
        attn_output_unpad = flash_attn_varlen_func(
            query_states, key_states, value_states,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_in_batch_q, max_seqlen_k=max_seqlen_in_batch_k,
            causal=is_causal,
        )
        return fa_utils._pad_input(attn_output_unpad, indices_q, batch_size, query_length)
    o = F.scaled_dot_product_attention(
        query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2), is_causal=is_causal
    )
    return o.transpose(1, 2)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class LlamaRMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LlamaFlashAttention2(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_embeddings):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn_output = _flash_attention_forward(q, k, v, attention_mask, q_len, is_causal=True)
        return self.o_proj(attn_output.reshape(bsz, q_len, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaFlashAttention2(config)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size, bias=False), nn.SiLU(),
            nn.Linear(config.intermediate_size, config.hidden_size, bias=False),
        )
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, attention_mask, position_embeddings):
        h = h + self.self_attn(self.input_layernorm(h), attention_mask, position_embeddings)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.hidden_size // config.num_attention_heads, 10000.0)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
        position_embeddings = self.rotary_emb(position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask, position_embeddings)
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return SimpleNamespace(loss=loss, logits=logits)


config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6)
config._attn_implementation = "flash_attention_2"
monkey_patch_packing_for_model(config)
model = LlamaForCausalLM(config).eval()

tokenizer = SimpleNamespace(padding_side="right", pad_token_id=0)
data_points = [
    {"input_ids": [5, 9, 11, 7, 3], "labels": [5, 9, 11, 7, 3]},
    {"input_ids": [6, 12, 8, 3], "labels": [-100, -100, 8, 3]},
    {"input_ids": [14, 2, 10, 13, 3], "labels": [-100, 2, 10, 13, 3]},
]
packed = [
    pack_data_points_FA(data_points[:2], tokenizer, model_max_length=12),
    pack_data_points_FA(data_points[2:], tokenizer, model_max_length=12),
]
batch = {k: torch.stack([p[k] for p in packed]) for k in packed[0]}
print("attention_mask:", batch["attention_mask"].tolist())

with torch.no_grad():
    out = model(**batch)
print("packed loss: %.6f" % out.loss.item())
print("data point 2 logits[0, 5:9, :4]:", out.logits[0, 5:9, :4])
