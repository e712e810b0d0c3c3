"""ESM-2 protein language model (facebookresearch/esm) on a batch of proteins of different lengths.

Follows esm/data.py (Alphabet.get_batch_converter / BatchConverter: <cls> + residues + <eos>, padded
on the right with padding_idx=1), esm/model/esm2.py (ESM2.forward: `padding_mask =
tokens.eq(self.padding_idx)`, zeroing padded embeddings, `if not padding_mask.any(): padding_mask =
None`, token_dropout rescaling) and esm/multihead_attention.py (MultiheadAttention: rotary q/k,
`attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))`).
Bidirectional: every residue (and <cls>/<eos>) attends to every non-pad token of its own protein.
"""
import math

import torch
import torch.nn as nn

ALPHABET = ["<cls>", "<pad>", "<eos>", "<unk>"] + list("LAGVSERTIDPKQNFYMHWCXBUZO.-") + ["<null_1>", "<mask>"]


class Alphabet:
    def __init__(self):
        self.all_toks = ALPHABET
        self.tok_to_idx = {t: i for i, t in enumerate(self.all_toks)}
        self.padding_idx = self.tok_to_idx["<pad>"]
        self.cls_idx = self.tok_to_idx["<cls>"]
        self.eos_idx = self.tok_to_idx["<eos>"]
        self.mask_idx = self.tok_to_idx["<mask>"]

    def get_batch_converter(self):
        return BatchConverter(self)


class BatchConverter:
    def __init__(self, alphabet):
        self.alphabet = alphabet

    def __call__(self, raw_batch):
        batch_labels, seq_str_list = zip(*raw_batch)
        seq_encoded_list = [[self.alphabet.tok_to_idx[c] for c in s] for s in seq_str_list]
        max_len = max(len(s) for s in seq_encoded_list)
        tokens = torch.full((len(raw_batch), max_len + 2), self.alphabet.padding_idx, dtype=torch.int64)
        for i, seq in enumerate(seq_encoded_list):
            tokens[i, 0] = self.alphabet.cls_idx
            tokens[i, 1:len(seq) + 1] = torch.tensor(seq, dtype=torch.int64)
            tokens[i, len(seq) + 1] = self.alphabet.eos_idx
        return list(batch_labels), list(seq_str_list), tokens


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, q, k):
        t = torch.arange(k.shape[-2]).type_as(self.inv_freq)
        emb = torch.cat((torch.outer(t, self.inv_freq),) * 2, dim=-1)
        cos, sin = emb.cos()[None], emb.sin()[None]

        def rot(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        return rot(q), rot(k)


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.rot_emb = RotaryEmbedding(dim=self.head_dim)

    def forward(self, query, key_padding_mask=None, need_head_weights=False):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(query)
        v = self.v_proj(query)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        q, k = self.rot_emb(q, k)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = torch.softmax(attn_weights.float(), dim=-1).type_as(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn_weights = attn_probs.view(bsz, self.num_heads, tgt_len, src_len).transpose(1, 0) if need_head_weights else None
        return self.out_proj(attn), attn_weights


class TransformerLayer(nn.Module):
    def __init__(self, embed_dim, ffn_embed_dim, attention_heads):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, self_attn_padding_mask=None, need_head_weights=False):
        residual = x
        x, attn = self.self_attn(self.self_attn_layer_norm(x), key_padding_mask=self_attn_padding_mask, need_head_weights=need_head_weights)
        x = residual + x
        x = x + self.fc2(nn.functional.gelu(self.fc1(self.final_layer_norm(x))))
        return x, attn


class ESM2(nn.Module):
    def __init__(self, num_layers=2, embed_dim=32, attention_heads=4, alphabet=None, token_dropout=True):
        super().__init__()
        self.alphabet = alphabet
        self.padding_idx, self.mask_idx = alphabet.padding_idx, alphabet.mask_idx
        self.token_dropout = token_dropout
        self.embed_scale = 1
        self.embed_tokens = nn.Embedding(len(alphabet.all_toks), embed_dim, padding_idx=self.padding_idx)
        self.layers = nn.ModuleList([TransformerLayer(embed_dim, 4 * embed_dim, attention_heads) for _ in range(num_layers)])
        self.emb_layer_norm_after = nn.LayerNorm(embed_dim)
        self.lm_head = nn.Linear(embed_dim, len(alphabet.all_toks))

    def forward(self, tokens, need_head_weights=False):
        padding_mask = tokens.eq(self.padding_idx)  # B, T
        x = self.embed_scale * self.embed_tokens(tokens)
        if self.token_dropout:
            x.masked_fill_((tokens == self.mask_idx).unsqueeze(-1), 0.0)
            mask_ratio_train = 0.15 * 0.8
            src_lengths = (~padding_mask).sum(-1)
            mask_ratio_observed = (tokens == self.mask_idx).sum(-1).to(x.dtype) / src_lengths
            x = x * (1 - mask_ratio_train) / (1 - mask_ratio_observed)[:, None, None]
        if padding_mask is not None:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        if not padding_mask.any():
            padding_mask = None
        x = x.transpose(0, 1)  # (B, T, E) => (T, B, E)
        attn_weights = []
        for layer in self.layers:
            x, attn = layer(x, self_attn_padding_mask=padding_mask, need_head_weights=need_head_weights)
            if need_head_weights:
                attn_weights.append(attn.transpose(1, 0))
        x = self.emb_layer_norm_after(x).transpose(0, 1)
        result = {"logits": self.lm_head(x)}
        if need_head_weights:
            attentions = torch.stack(attn_weights, 1)
            if padding_mask is not None:
                attention_mask = 1 - padding_mask.type_as(attentions)
                attention_mask = attention_mask.unsqueeze(1) * attention_mask.unsqueeze(2)
                attentions = attentions * attention_mask[:, None, None, :, :]
            result["attentions"] = attentions
        return result


def main():
    torch.manual_seed(0)
    alphabet = Alphabet()
    model = ESM2(alphabet=alphabet).eval()
    batch_converter = alphabet.get_batch_converter()
    data = [("protein1", "MKTVRQERLKSIVRILERSKEPVSGAQ"), ("protein2", "KALTARQQEVFDLIRD"), ("protein3", "KAISGKALTAR")]
    batch_labels, batch_strs, batch_tokens = batch_converter(data)
    with torch.no_grad():
        results = model(batch_tokens, need_head_weights=True)
    batch_lens = (batch_tokens != alphabet.padding_idx).sum(1)
    # per-protein contact-style attention summary over real residues only (esm README)
    for i, tokens_len in enumerate(batch_lens.tolist()):
        a = results["attentions"][i, -1, :, 1:tokens_len - 1, 1:tokens_len - 1].mean(0)
        print(batch_labels[i], tokens_len - 2, f"{a.sum(-1).mean().item():.4f}")


if __name__ == "__main__":
    main()
