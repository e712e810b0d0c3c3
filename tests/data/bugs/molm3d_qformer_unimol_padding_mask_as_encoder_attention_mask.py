"""3D-MoLM: the Q-Former reads Uni-Mol's padding mask as its encoder attention mask.

Citation: lsh0520/3D-MoLM#8 ("Questions about 3D-MoLM", point 1). In `model/blip2qformer.py`
(`Blip2Qformer.forward`, stored commit 9dbd993) the graph encoder `SimpleUniMolModel.forward`
returns `(encoder_rep, padding_mask)` where `padding_mask = src_tokens.eq(self.padding_idx)`
(True = padding atom), and that tensor is passed straight on as
`self.Qformer.bert(query_embeds=..., encoder_hidden_states=batch_node,
encoder_attention_mask=batch_mask)` -- the source itself carries the comment
"fixme: check whether this mask is correct". The BLIP-2 Q-Former is a BERT whose
`encoder_attention_mask` is 1 for keys to attend, so the learned queries attend only the padding
atoms of every padded molecule and never its real atoms. The reporter says the mask "is contrary
with the format of Transformers"; I read the issue's description and the first maintainer reply
(which forwards point 1 to a co-author) but not a later answer, so the fix used here is the one
the issue implies: hand the Q-Former the complement, `~batch_mask` (True = real atom).

This program keeps the project's shapes: a Uni-Mol-style encoder (pair-biased self-attention
with `padding_mask` on the keys) over a batch of two molecules of 7 and 4 atom tokens padded to 7,
then one BERT cross-attention layer of the Q-Former (8 query tokens) computing
softmax(q @ k.T + extended mask), the mask built by BERT's `invert_attention_mask` from
`encoder_attention_mask`. Buggy: the 4-atom molecule's queries attend its 3 padding slots only.
`--fixed` passes `~batch_mask`.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Dictionary:
    def __init__(self, symbols):
        self.symbols = ["[CLS]", "[PAD]", "[SEP]", "[UNK]"] + symbols

    def pad(self):
        return 1

    def __len__(self):
        return len(self.symbols)


class SelfMultiheadAttention(nn.Module):
    """unicore's self-attention: the pair bias added to the scores, padding keys set to -inf."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.in_proj = nn.Linear(embed_dim, embed_dim * 3)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key_padding_mask=None, attn_bias=None):
        bsz, tgt_len, embed_dim = query.size()
        q, k, v = self.in_proj(query).chunk(3, dim=-1)
        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2) * self.head_dim ** -0.5
        k = k.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = q @ k.transpose(-1, -2)
        if attn_bias is not None:
            attn_weights = attn_weights + attn_bias.view(bsz, self.num_heads, tgt_len, tgt_len)
        if key_padding_mask is not None:
            attn_weights = attn_weights.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        attn = F.softmax(attn_weights, dim=-1)
        o = (attn @ v).transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(o)


class SimpleUniMolModel(nn.Module):
    def __init__(self, args, dictionary):
        super().__init__()
        self.args = args
        self.padding_idx = dictionary.pad()
        self.embed_tokens = nn.Embedding(len(dictionary), args.unimol_encoder_embed_dim, self.padding_idx)
        self.gbf_proj = nn.Linear(1, args.unimol_encoder_attention_heads)
        self.attn = SelfMultiheadAttention(args.unimol_encoder_embed_dim, args.unimol_encoder_attention_heads)
        self.num_features = args.unimol_encoder_embed_dim

    def forward(self, src_tokens, src_distance, src_edge_type):
        padding_mask = src_tokens.eq(self.padding_idx)
        if not padding_mask.any():
            padding_mask = None
        x = self.embed_tokens(src_tokens)
        n_node = src_distance.size(-1)
        graph_attn_bias = self.gbf_proj(src_distance.unsqueeze(-1)).permute(0, 3, 1, 2).contiguous()
        graph_attn_bias = graph_attn_bias.view(-1, n_node, n_node)
        encoder_rep = x + self.attn(x, key_padding_mask=padding_mask, attn_bias=graph_attn_bias)
        return encoder_rep, padding_mask


class BertCrossAttention(nn.Module):
    """The Q-Former's crossattention: keys and values from the graph encoder's output."""

    def __init__(self, hidden_size, encoder_width, num_attention_heads):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(encoder_width, hidden_size)
        self.value = nn.Linear(encoder_width, hidden_size)

    def transpose_for_scores(self, x):
        b, n, _ = x.size()
        return x.view(b, n, self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(encoder_hidden_states))
        value_layer = self.transpose_for_scores(self.value(encoder_hidden_states))
        attention_scores = query_layer @ key_layer.transpose(-1, -2)
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + encoder_attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        context = (attention_probs @ value_layer).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), -1)


class QformerBert(nn.Module):
    def __init__(self, hidden_size, encoder_width, heads):
        super().__init__()
        self.crossattention = BertCrossAttention(hidden_size, encoder_width, heads)

    def invert_attention_mask(self, encoder_attention_mask):
        encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :]
        encoder_extended_attention_mask = encoder_extended_attention_mask.to(torch.float32)
        return (1.0 - encoder_extended_attention_mask) * torch.finfo(torch.float32).min

    def forward(self, query_embeds, encoder_hidden_states, encoder_attention_mask=None):
        if encoder_attention_mask is None:
            encoder_attention_mask = torch.ones(encoder_hidden_states.shape[:-1], dtype=torch.long)
        encoder_extended_attention_mask = self.invert_attention_mask(encoder_attention_mask)
        return self.crossattention(query_embeds, encoder_hidden_states, encoder_extended_attention_mask)


class Args:
    unimol_encoder_embed_dim = 32
    unimol_encoder_attention_heads = 4


class Blip2Qformer(nn.Module):
    def __init__(self, dictionary, num_query_token=8, qformer_hidden=32):
        super().__init__()
        self.graph_encoder = SimpleUniMolModel(Args(), dictionary)
        self.ln_graph = nn.LayerNorm(self.graph_encoder.num_features)
        self.query_tokens = nn.Parameter(torch.randn(1, num_query_token, qformer_hidden) * 0.02)
        self.Qformer_bert = QformerBert(qformer_hidden, self.graph_encoder.num_features, 4)

    def forward(self, graph_batch):
        batch_node, batch_mask = self.graph_encoder(*graph_batch)
        batch_node = self.ln_graph(batch_node)
        query_tokens = self.query_tokens.expand(batch_node.shape[0], -1, -1)
        if FIXED:
            encoder_attention_mask = ~batch_mask
        else:
            encoder_attention_mask = batch_mask  # fixme: check whether this mask is correct
        return self.Qformer_bert(
            query_embeds=query_tokens,
            encoder_hidden_states=batch_node,
            encoder_attention_mask=encoder_attention_mask,
        )


def collate(mols, pad_idx):
    n = max(len(m) for m in mols)
    src_tokens = torch.full((len(mols), n), pad_idx, dtype=torch.long)
    src_distance = torch.zeros(len(mols), n, n)
    src_edge_type = torch.zeros(len(mols), n, n, dtype=torch.long)
    for i, (toks, coords) in enumerate((m, torch.randn(len(m), 3)) for m in mols):
        src_tokens[i, : len(toks)] = torch.tensor(toks)
        src_distance[i, : len(toks), : len(toks)] = torch.cdist(coords, coords)
    return src_tokens, src_distance, src_edge_type


def main():
    torch.manual_seed(0)
    dictionary = Dictionary(["C", "N", "O", "S", "H"])
    model = Blip2Qformer(dictionary).eval()
    # [CLS] atoms [SEP]: a 7-token molecule and a 4-token molecule padded to 7
    mols = [[0, 4, 4, 5, 6, 4, 2], [0, 4, 5, 2]]
    with torch.no_grad():
        out = model(collate(mols, dictionary.pad()))
    print("graph query features", tuple(out.shape), "mol 1 norm %.4f" % out[1].norm().item())


if __name__ == "__main__":
    main()
