# Code-Amadeus/Amadeus#22 (fixes #21), "fix(tts): prevent runaway GPT-SoVITS filler vowels".
# Before: GPT_SoVITS/AR/models/t2s_model.py @3ef2d01d; after: @33b1c6c0 (both read).
# The T2S decoder (VALL-E style: [text+bert | prompt semantic tokens] prefilled, then one semantic token per step)
# copies the prompt KV into a zero-filled static bucket (128/256/...) and decodes with
# T2SBlockWithStaticCache.decode_next_token_with_static_cache, which scatters the new K/V at pos_idx and runs
# SDPA over the whole bucket with no mask: the unwritten zero slots get logit 0 and real softmax weight.
# Fix: a key_valid_mask over the bucket (Graph path) and, on the plain static path, attention over the
# contiguous valid prefix k_cache[:, :current_len + 1].
import math
import sys
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

_GRAPH_INITIAL_LEN_STRIDE = 32


def logits_to_probs(logits, previous_tokens=None, temperature=1.0, top_k=None, top_p=None, repetition_penalty=1.0):
    if previous_tokens is not None:
        previous_tokens = previous_tokens.squeeze()
    if previous_tokens is not None and repetition_penalty != 1.0:
        previous_tokens = previous_tokens.long()
        score = torch.gather(logits, dim=1, index=previous_tokens.unsqueeze(0))
        score = torch.where(score < 0, score * repetition_penalty, score / repetition_penalty)
        logits.scatter_(dim=1, index=previous_tokens.unsqueeze(0), src=score)
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v[:, -1].unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    return torch.nn.functional.softmax(logits, dim=-1)


def multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def sample(logits, previous_tokens, **sampling_kwargs):
    probs = logits_to_probs(logits=logits, previous_tokens=previous_tokens, **sampling_kwargs)
    idx_next = multinomial_sample_one_no_sync(probs)
    return idx_next, probs


class SinePositionalEmbedding(nn.Module):
    def __init__(self, embedding_dim, dropout=0.0, scale=False, alpha=False, max_len=4000):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.x_scale = math.sqrt(embedding_dim) if scale else 1.0
        self.alpha = nn.Parameter(torch.ones(1), requires_grad=alpha)
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, embedding_dim)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, embedding_dim, 2, dtype=torch.float32) * -(math.log(10000.0) / embedding_dim))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = pe.unsqueeze(0)

    def forward(self, x):
        output = x * self.x_scale + self.alpha * self.pe[:, : x.size(1)]
        return self.dropout(output)


class T2SMLP:
    def __init__(self, w1, b1, w2, b2):
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2

    def forward(self, x):
        x = F.relu(F.linear(x, self.w1, self.b1))
        return F.linear(x, self.w2, self.b2)


class T2SBlockWithStaticCache:
    def __init__(self, num_heads, hidden_dim, mlp, qkv_w, qkv_b, out_w, out_b,
                 norm_w1, norm_b1, norm_eps1, norm_w2, norm_b2, norm_eps2):
        self.num_heads = num_heads
        self.mlp = mlp
        self.hidden_dim = hidden_dim
        self.qkv_w, self.qkv_b, self.out_w, self.out_b = qkv_w, qkv_b, out_w, out_b
        self.norm_w1, self.norm_b1, self.norm_eps1 = norm_w1, norm_b1, norm_eps1
        self.norm_w2, self.norm_b2, self.norm_eps2 = norm_w2, norm_b2, norm_eps2

    def _finish(self, x, attn):
        x = x + attn
        x = F.layer_norm(x, [self.hidden_dim], self.norm_w1, self.norm_b1, self.norm_eps1)
        x = x + self.mlp.forward(x)
        return F.layer_norm(x, [self.hidden_dim], self.norm_w2, self.norm_b2, self.norm_eps2)

    def process_prompt(self, x, attn_mask, padding_mask=None, torch_sdpa=True):
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        batch_size, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
        k_cache, v_cache = k, v
        q = q.view(batch_size, q_len, self.num_heads, -1).transpose(1, 2)
        k = k_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        v = v_cache.view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, ~attn_mask)
        attn = attn.transpose(1, 2).reshape(batch_size, q_len, -1)
        attn = F.linear(attn, self.out_w, self.out_b)
        return self._finish(x, attn), k_cache, v_cache

    def decode_next_token_with_static_cache(self, x, k_cache, v_cache, pos_idx,
                                            key_valid_mask=None, valid_kv_len: int = -1, torch_sdpa=True):
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        k_cache.scatter_(1, pos_idx, k)
        v_cache.scatter_(1, pos_idx, v)
        batch_size = q.shape[0]
        if FIXED:
            kv_len = valid_kv_len if valid_kv_len > 0 else k_cache.shape[1]
        else:
            kv_len = k_cache.shape[1]  # always bucket_size (static shape, CUDA Graph friendly)
        q = q.view(batch_size, 1, self.num_heads, -1).transpose(1, 2)
        k_full = k_cache[:, :kv_len, :].view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        v_full = v_cache[:, :kv_len, :].view(batch_size, kv_len, self.num_heads, -1).transpose(1, 2)
        if FIXED and valid_kv_len <= 0:
            valid_attn_mask = key_valid_mask.unsqueeze(1).unsqueeze(1)
            attn = F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=valid_attn_mask)
        else:
            attn = F.scaled_dot_product_attention(q, k_full, v_full)
        attn = attn.transpose(1, 2).reshape(batch_size, 1, -1)
        attn = F.linear(attn, self.out_w, self.out_b)
        return self._finish(x, attn), k_cache, v_cache


class T2STransformerWithStaticCache:
    def __init__(self, num_blocks, blocks):
        self.num_blocks = num_blocks
        self.blocks = blocks

    def process_prompt(self, x, attn_mask, padding_mask=None, torch_sdpa=True):
        k_cache, v_cache = [], []
        for i in range(self.num_blocks):
            x, k_cache_, v_cache_ = self.blocks[i].process_prompt(x, attn_mask, padding_mask, torch_sdpa)
            k_cache.append(k_cache_)
            v_cache.append(v_cache_)
        return x, k_cache, v_cache

    def decode_next_token_with_static_cache(self, x, k_cache, v_cache, pos_idx,
                                            key_valid_mask=None, valid_kv_len: int = -1, torch_sdpa=True):
        if FIXED:
            key_valid_mask.scatter_(1, pos_idx[:, :, 0], True)
        for i in range(self.num_blocks):
            x, k_cache[i], v_cache[i] = self.blocks[i].decode_next_token_with_static_cache(
                x, k_cache[i], v_cache[i], pos_idx, key_valid_mask, valid_kv_len, torch_sdpa)
        return x, k_cache, v_cache


class Text2SemanticDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model_dim = config["model"]["hidden_dim"]
        self.embedding_dim = config["model"]["embedding_dim"]
        self.num_head = config["model"]["head"]
        self.num_layers = config["model"]["n_layer"]
        self.vocab_size = config["model"]["vocab_size"]
        self.phoneme_vocab_size = config["model"]["phoneme_vocab_size"]
        self.EOS = config["model"]["EOS"]
        self.bert_proj = nn.Linear(1024, self.embedding_dim)
        self.ar_text_embedding = nn.Embedding(self.phoneme_vocab_size, self.embedding_dim)
        self.ar_text_position = SinePositionalEmbedding(self.embedding_dim, dropout=0.1, scale=False, alpha=True)
        self.ar_audio_embedding = nn.Embedding(self.vocab_size, self.embedding_dim)
        self.ar_audio_position = SinePositionalEmbedding(self.embedding_dim, dropout=0.1, scale=False, alpha=True)
        self.h = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model=self.model_dim, nhead=self.num_head,
                                       dim_feedforward=self.model_dim * 4, dropout=0.1, batch_first=True),
            num_layers=self.num_layers)
        self.ar_predict_layer = nn.Linear(self.model_dim, self.vocab_size, bias=False)
        self.use_static_kv_cache = torch.cuda.is_available()
        self.kv_cache_buckets = [128, 256, 448, 512, 768, 1024]
        blocks_static = []
        for i in range(self.num_layers):
            layer = self.h.layers[i]
            t2smlp = T2SMLP(layer.linear1.weight, layer.linear1.bias, layer.linear2.weight, layer.linear2.bias)
            blocks_static.append(T2SBlockWithStaticCache(
                self.num_head, self.model_dim, t2smlp,
                layer.self_attn.in_proj_weight, layer.self_attn.in_proj_bias,
                layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias,
                layer.norm1.weight, layer.norm1.bias, layer.norm1.eps,
                layer.norm2.weight, layer.norm2.bias, layer.norm2.eps))
        self.t2s_transformer_static = T2STransformerWithStaticCache(self.num_layers, blocks_static)

    _BUCKET_MIN_GEN_SLOTS: int = 96

    def _select_bucket(self, kv_cache_len):
        if not self.kv_cache_buckets:
            return None
        _s = _GRAPH_INITIAL_LEN_STRIDE
        aligned = ((kv_cache_len + _s - 1) // _s) * _s
        min_needed = aligned + self._BUCKET_MIN_GEN_SLOTS
        for bucket_size in self.kv_cache_buckets:
            if min_needed < bucket_size:
                return bucket_size
        return None

    @torch.no_grad()
    def infer_panel_naive(self, x, x_lens, prompts, bert_feature, top_k=-100, top_p=100,
                          early_stop_num=-1, temperature=1.0, repetition_penalty=1.35, **kwargs):
        x = self.ar_text_embedding(x)
        x = x + self.bert_proj(bert_feature.transpose(1, 2))
        x = self.ar_text_position(x)
        y = prompts
        x_len = x.shape[1]
        x_attn_mask = torch.zeros((x_len, x_len), dtype=torch.bool)
        stop = False
        y_emb = self.ar_audio_embedding(y)
        y_len = y_emb.shape[1]
        prefix_len = y.shape[1]
        y_pos = self.ar_audio_position(y_emb)
        xy_pos = torch.concat([x, y_pos], dim=1)
        bsz = x.shape[0]
        src_len = x_len + y_len
        x_attn_mask_pad = F.pad(x_attn_mask, (0, y_len), value=True)
        y_attn_mask = F.pad(torch.triu(torch.ones(y_len, y_len, dtype=torch.bool), diagonal=1), (x_len, 0), value=False)
        xy_attn_mask = torch.concat([x_attn_mask_pad, y_attn_mask], dim=0).unsqueeze(0)\
            .expand(bsz * self.num_head, -1, -1).view(bsz, self.num_head, src_len, src_len).to(device=x.device, dtype=torch.bool)

        enable_static_kv = kwargs.get("enable_static_kv", self.use_static_kv_cache)
        current_bucket = None
        current_lens = None
        pos_idx_static = None
        key_valid_mask = None
        transformer = self.t2s_transformer_static
        static_mode_active = enable_static_kv

        for idx in range(1500):
            if xy_attn_mask is not None:
                xy_dec, k_cache, v_cache = transformer.process_prompt(xy_pos, xy_attn_mask, None)
                logits = self.ar_predict_layer(xy_dec[:, -1])
                if static_mode_active and k_cache is not None:
                    kv_cache_len = k_cache[0].shape[1]
                    current_bucket = self._select_bucket(kv_cache_len)
                    batch_size, hidden_dim = k_cache[0].shape[0], k_cache[0].shape[2]
                    k_cache_static = [torch.zeros(batch_size, current_bucket, hidden_dim) for _ in range(len(k_cache))]
                    v_cache_static = [torch.zeros(batch_size, current_bucket, hidden_dim) for _ in range(len(v_cache))]
                    for i in range(len(k_cache)):
                        k_cache_static[i][:, :kv_cache_len, :] = k_cache[i]
                        v_cache_static[i][:, :kv_cache_len, :] = v_cache[i]
                    k_cache, v_cache = k_cache_static, v_cache_static
                    current_lens = [kv_cache_len] * len(k_cache)
                    pos_idx_static = torch.full((batch_size, 1, hidden_dim), kv_cache_len, dtype=torch.long)
                    if FIXED:
                        key_valid_mask = torch.zeros(batch_size, current_bucket, dtype=torch.bool)
                        key_valid_mask[:, :kv_cache_len] = True
                    print(f"[T2S] fixed buffer initialized: bucket={current_bucket} current_len={kv_cache_len}")
            else:
                pos_idx_static.fill_(current_lens[0])
                xy_dec, k_cache, v_cache = transformer.decode_next_token_with_static_cache(
                    xy_pos, k_cache, v_cache, pos_idx_static, key_valid_mask,
                    current_lens[0] + 1 if FIXED else -1)
                current_lens = [l + 1 for l in current_lens]
                logits = self.ar_predict_layer(xy_dec[:, -1])

            if idx == 0:
                xy_attn_mask = None
            if idx < 11:
                logits = logits[:, :-1]
            samples = sample(logits, y, top_k=top_k, top_p=top_p,
                             repetition_penalty=repetition_penalty, temperature=temperature)[0]
            y = torch.concat([y, samples], dim=1)
            if early_stop_num != -1 and (y.shape[1] - prefix_len) > early_stop_num:
                stop = True
            if torch.argmax(logits, dim=-1)[0] == self.EOS or samples[0, 0] == self.EOS:
                stop = True
            if stop:
                print(f"T2S Decoding EOS [{prefix_len} -> {y.shape[1]}]")
                break
            y_emb = self.ar_audio_embedding(y[:, -1:])
            xy_pos = y_emb * self.ar_audio_position.x_scale + self.ar_audio_position.alpha * \
                self.ar_audio_position.pe[:, y_len + idx].to(dtype=y_emb.dtype, device=y_emb.device)
        return y[:, :-1], idx


def main():
    config = {"model": {"hidden_dim": 64, "embedding_dim": 64, "head": 4, "n_layer": 2,
                        "vocab_size": 65, "phoneme_vocab_size": 40, "dropout": 0.0, "EOS": 64}}
    model = Text2SemanticDecoder(config).eval()
    x = torch.randint(0, 40, (1, 14))            # all phones: prompt text + target text
    x_lens = torch.tensor([14])
    prompts = torch.randint(0, 64, (1, 9))       # reference audio's semantic tokens
    bert_feature = torch.randn(1, 1024, 14) * 0.05
    torch.manual_seed(1)
    pred_semantic, idx = model.infer_panel_naive(x, x_lens, prompts, bert_feature, top_k=1,
                                                 early_stop_num=24, enable_static_kv=True)
    print("semantic tokens:", pred_semantic[0, prompts.shape[1]:].tolist())


if __name__ == "__main__":
    main()
