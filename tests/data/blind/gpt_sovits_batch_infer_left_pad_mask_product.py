"""GPT-SoVITS batched T2S inference: the left-padding mask only blocked pad-to-pad pairs.

Citation: RVC-Boss/GPT-SoVITS PR #2153 ("修复gpt的padding mask的问题" = fix the GPT padding mask
problem), merged as commit 053a356ffe3d72b475d512b4f48b229e9b145f19.  Source read:
GPT_SoVITS/AR/models/t2s_model.py `Text2SemanticDecoder.infer_panel_batch_infer` and `T2SBlock`
before the commit, and the diff.

Bug: text sequences of a batch are left-padded (`make_pad_mask_left`, True = pad) and the mask
(True = blocked, passed to SDPA as `~attn_mask`) was built as
`padding_mask = padding_mask.unsqueeze(1) * padding_mask.unsqueeze(2)` — True only where query
*and* key are padding.  Every real text/audio token of a shorter sequence therefore attends to
the zero pad slots, in the prompt pass and (through the kept last row) in every decode step;
the author's comment: "上面是错误的，会导致padding的token被'看见'" (wrong: pad tokens are seen).
Fix (053a356): `padding_mask = padding_mask.view(bsz, 1, src_len).repeat(1, src_len, 1)` —
pad keys are blocked for all queries.

Reproduction: a 2-block T2S transformer (weights as tensors, as in T2SBlock) on a batch of two
texts of 6 and 3 tokens (left-padded to 6) with a 2-token audio prompt each; prefill plus 3
greedy decode steps with the KV cache and the same `attn_mask` update as upstream.
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def make_pad_mask_left(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    """2-D bool tensor, True on (left) padded positions."""
    max_len = max(max_len, int(lengths.max()))
    n = lengths.size(0)
    seq_range = torch.arange(0, max_len, device=lengths.device)
    expaned_lengths = seq_range.unsqueeze(0).repeat(n, 1)
    expaned_lengths -= (max_len - lengths).unsqueeze(-1)
    return expaned_lengths < 0


class SinePositionalEmbedding(nn.Module):
    def __init__(self, dim_model, max_len=256):
        super().__init__()
        self.x_scale = math.sqrt(dim_model)
        self.alpha = nn.Parameter(torch.ones(1))
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, dim_model, 2) * -(math.log(10000.0) / dim_model))
        pe = torch.zeros(1, max_len, dim_model)
        pe[0, :, 0::2] = torch.sin(position * div_term)
        pe[0, :, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x * self.x_scale + self.alpha * self.pe[:, : x.size(1)]


class T2SMLP:
    def __init__(self, w1, b1, w2, b2):
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2

    def forward(self, x):
        return F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


class T2SBlock:
    def __init__(self, num_heads, hidden_dim, mlp, qkv_w, qkv_b, out_w, out_b):
        self.num_heads = num_heads
        self.mlp = mlp
        self.hidden_dim = hidden_dim
        self.qkv_w, self.qkv_b, self.out_w, self.out_b = qkv_w, qkv_b, out_w, out_b

    def _heads(self, t, batch_size, length):
        return t.view(batch_size, length, self.num_heads, -1).transpose(1, 2)

    def _finish(self, x, attn):
        x = F.layer_norm(x + attn, [self.hidden_dim])
        return F.layer_norm(x + self.mlp.forward(x), [self.hidden_dim])

    def process_prompt(self, x, attn_mask):
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        batch_size, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
        k_cache, v_cache = k, v
        attn = F.scaled_dot_product_attention(
            self._heads(q, batch_size, q_len), self._heads(k, batch_size, kv_len),
            self._heads(v, batch_size, kv_len), ~attn_mask)
        attn = F.linear(attn.transpose(1, 2).reshape(batch_size, q_len, -1), self.out_w, self.out_b)
        return self._finish(x, attn), k_cache, v_cache

    def decode_next_token(self, x, k_cache, v_cache, attn_mask=None):
        q, k, v = F.linear(x, self.qkv_w, self.qkv_b).chunk(3, dim=-1)
        k_cache = torch.cat([k_cache, k], dim=1)
        v_cache = torch.cat([v_cache, v], dim=1)
        batch_size, q_len, kv_len = q.shape[0], q.shape[1], k_cache.shape[1]
        attn = F.scaled_dot_product_attention(
            self._heads(q, batch_size, q_len), self._heads(k_cache, batch_size, kv_len),
            self._heads(v_cache, batch_size, kv_len), (~attn_mask) if attn_mask is not None else None)
        attn = F.linear(attn.transpose(1, 2).reshape(batch_size, q_len, -1), self.out_w, self.out_b)
        return self._finish(x, attn), k_cache, v_cache


class T2STransformer:
    def __init__(self, num_blocks, blocks):
        self.num_blocks = num_blocks
        self.blocks = blocks

    def process_prompt(self, x, attn_mask):
        k_cache, v_cache = [], []
        for i in range(self.num_blocks):
            x, k_cache_, v_cache_ = self.blocks[i].process_prompt(x, attn_mask)
            k_cache.append(k_cache_)
            v_cache.append(v_cache_)
        return x, k_cache, v_cache

    def decode_next_token(self, x, k_cache, v_cache, attn_mask=None):
        for i in range(self.num_blocks):
            x, k_cache[i], v_cache[i] = self.blocks[i].decode_next_token(x, k_cache[i], v_cache[i], attn_mask)
        return x, k_cache, v_cache


class Text2SemanticDecoder(nn.Module):
    def __init__(self, model_dim=32, num_head=4, num_layers=2, phoneme_vocab_size=50, vocab_size=64, bert_dim=16):
        super().__init__()
        self.model_dim, self.num_head = model_dim, num_head
        self.bert_proj = nn.Linear(bert_dim, model_dim)
        self.ar_text_embedding = nn.Embedding(phoneme_vocab_size, model_dim)
        self.ar_text_position = SinePositionalEmbedding(model_dim)
        self.ar_audio_embedding = nn.Embedding(vocab_size, model_dim)
        self.ar_audio_position = SinePositionalEmbedding(model_dim)
        self.ar_predict_layer = nn.Linear(model_dim, vocab_size, bias=False)
        g = lambda *s: torch.randn(*s) * 0.2
        self.t2s_transformer = T2STransformer(num_layers, [
            T2SBlock(num_head, model_dim, T2SMLP(g(64, model_dim), g(64), g(model_dim, 64), g(model_dim)),
                     g(3 * model_dim, model_dim), g(3 * model_dim), g(model_dim, model_dim), g(model_dim))
            for _ in range(num_layers)])

    def infer_panel_batch_infer(self, x, x_lens, prompts, bert_feature, steps=3):
        max_len = int(x_lens.max())
        x_list = []
        for x_item, bert_item in zip(x, bert_feature):
            x_item = self.ar_text_embedding(x_item.unsqueeze(0))
            x_item = x_item + self.bert_proj(bert_item.transpose(0, 1).unsqueeze(0))
            x_item = self.ar_text_position(x_item).squeeze(0)
            x_item = F.pad(x_item, (0, 0, max_len - x_item.shape[0], 0), value=0) if x_item.shape[0] < max_len \
                else x_item  ### padding left
            x_list.append(x_item)
        x = torch.stack(x_list, dim=0)

        y = prompts
        x_len = x.shape[1]
        y_emb = self.ar_audio_embedding(y)
        y_len = y_emb.shape[1]
        y_lens = torch.LongTensor([y_emb.shape[1]] * y_emb.shape[0])
        y_pos = self.ar_audio_position(y_emb)
        xy_pos = torch.concat([x, y_pos], dim=1)

        ##### create mask #####
        bsz = x.shape[0]
        src_len = x_len + y_len
        y_paddind_mask = make_pad_mask_left(y_lens, y_len)
        x_paddind_mask = make_pad_mask_left(x_lens, max_len)
        # (bsz, x_len + y_len)
        padding_mask = torch.concat([x_paddind_mask, y_paddind_mask], dim=1)
        x_mask = F.pad(torch.zeros(x_len, x_len, dtype=torch.bool), (0, y_len), value=True)
        y_mask = F.pad(torch.triu(torch.ones(y_len, y_len, dtype=torch.bool), diagonal=1), (x_len, 0), value=False)
        causal_mask = torch.concat([x_mask, y_mask], dim=0).view(1, src_len, src_len).repeat(bsz, 1, 1)
        if FIXED:
            padding_mask = padding_mask.view(bsz, 1, src_len).repeat(1, src_len, 1)
        else:
            padding_mask = padding_mask.unsqueeze(1) * padding_mask.unsqueeze(2)  ### [b, x+y, x+y]
        attn_mask = causal_mask.logical_or(padding_mask)
        attn_mask = attn_mask.unsqueeze(1).expand(-1, self.num_head, -1, -1).bool()

        ###### decode #####
        k_cache = v_cache = None
        for idx in range(steps):
            if idx == 0:
                xy_dec, k_cache, v_cache = self.t2s_transformer.process_prompt(xy_pos, attn_mask)
            else:
                xy_dec, k_cache, v_cache = self.t2s_transformer.decode_next_token(xy_pos, k_cache, v_cache, attn_mask)
            logits = self.ar_predict_layer(xy_dec[:, -1])
            if idx == 0:
                attn_mask = F.pad(attn_mask[:, :, -1].unsqueeze(-2), (0, 1), value=False)
            else:
                attn_mask = F.pad(attn_mask, (0, 1), value=False)
            samples = logits.argmax(dim=-1, keepdim=True)
            y = torch.concat([y, samples], dim=1)
            y_emb = self.ar_audio_embedding(y[:, -1:])
            xy_pos = y_emb * self.ar_audio_position.x_scale + self.ar_audio_position.alpha * \
                self.ar_audio_position.pe[:, y_len + idx]
        return y, logits


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Text2SemanticDecoder().eval()
    x = [torch.tensor([3, 7, 9, 11, 4, 5]), torch.tensor([8, 2, 6])]
    x_lens = torch.tensor([6, 3])
    bert_feature = [torch.randn(16, 6), torch.randn(16, 3)]
    prompts = torch.tensor([[10, 20], [30, 40]])
    with torch.no_grad():
        y, logits = model.infer_panel_batch_infer(x, x_lens, prompts, bert_feature)
    print(f"semantic tokens: {y.tolist()}, last logits[1] sum {logits[1].sum().item():.4f}")
