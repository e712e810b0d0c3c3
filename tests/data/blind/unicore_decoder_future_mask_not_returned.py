# dptech-corp/Uni-Core commit 49c9895 ("fix bug in return future mask"), unicore/modules/transformer_decoder.py.
# TransformerDecoder.get_future_mask built the causal (future) mask when no attn_mask came in (rel_pos=False),
# but did not return it, so the auto-regressive decoder ran with attn_mask None; the fix returns `ret`.
# Here: a SMILES decoder (Uni-Core decoder, rel_pos off) teacher-forced on a right-padded batch of two molecules,
# cross-attending a small encoder output.
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv

LayerNorm = nn.LayerNorm


def get_activation_fn(activation):
    if activation == "relu":
        return F.relu
    elif activation == "gelu":
        return F.gelu
    elif activation == "tanh":
        return torch.tanh
    raise RuntimeError("--activation-fn {} not supported".format(activation))


# unicore/modules/softmax_dropout.py (the CPU branch; the CUDA branch calls a fused kernel)
def softmax_dropout(input, dropout_prob, is_training=True, mask=None, bias=None):
    input = input.contiguous()
    if mask is not None:
        input += mask
    if bias is not None:
        input += bias
    return F.dropout(F.softmax(input, dim=-1), p=dropout_prob, training=is_training)


# unicore/modules/multihead_attention.py
class SelfMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1, bias=True, scaling_factor=1):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim, "embed_dim must be divisible by num_heads"
        self.scaling = (self.head_dim * scaling_factor) ** -0.5
        self.in_proj = nn.Linear(embed_dim, embed_dim * 3, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, query, key_padding_mask: Optional[Tensor] = None, attn_bias: Optional[Tensor] = None,
                return_attn: bool = False) -> Tensor:
        bsz, tgt_len, embed_dim = query.size()
        assert embed_dim == self.embed_dim

        q, k, v = self.in_proj(query).chunk(3, dim=-1)

        q = (
            q.view(bsz, tgt_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
            .contiguous()
            .view(bsz * self.num_heads, -1, self.head_dim)
            * self.scaling
        )
        k = k.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous().view(
            bsz * self.num_heads, -1, self.head_dim)
        v = v.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous().view(
            bsz * self.num_heads, -1, self.head_dim)
        src_len = k.size(1)

        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None

        if key_padding_mask is not None:
            assert key_padding_mask.size(0) == bsz
            assert key_padding_mask.size(1) == src_len

        attn_weights = torch.bmm(q, k.transpose(1, 2))

        assert list(attn_weights.size()) == [bsz * self.num_heads, tgt_len, src_len]

        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if not return_attn:
            attn = softmax_dropout(attn_weights, self.dropout, self.training, bias=attn_bias)
        else:
            attn_weights += attn_bias
            attn = softmax_dropout(attn_weights, self.dropout, self.training)

        o = torch.bmm(attn, v)
        assert list(o.size()) == [bsz * self.num_heads, tgt_len, self.head_dim]
        o = o.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2).contiguous().view(
            bsz, tgt_len, embed_dim)
        o = self.out_proj(o)
        if not return_attn:
            return o
        else:
            return o, attn_weights, attn


class CrossMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1, bias=True, scaling_factor=1):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == self.embed_dim, "embed_dim must be divisible by num_heads"
        self.scaling = (self.head_dim * scaling_factor) ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, query, key, value, key_padding_mask: Optional[Tensor] = None,
                attn_bias: Optional[Tensor] = None) -> Tensor:
        bsz, tgt_len, embed_dim = query.size()
        assert embed_dim == self.embed_dim

        q = self.q_proj(query)
        k = self.k_proj(key)
        v = self.v_proj(value)

        q = (
            q.view(bsz, tgt_len, self.num_heads, self.head_dim)
            .transpose(1, 2)
            .contiguous()
            .view(bsz * self.num_heads, -1, self.head_dim)
            * self.scaling
        )
        k = k.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous().view(
            bsz * self.num_heads, -1, self.head_dim)
        v = v.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous().view(
            bsz * self.num_heads, -1, self.head_dim)
        src_len = k.size(1)

        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None

        if key_padding_mask is not None:
            assert key_padding_mask.size(0) == bsz
            assert key_padding_mask.size(1) == src_len

        attn_weights = torch.bmm(q, k.transpose(1, 2))

        assert list(attn_weights.size()) == [bsz * self.num_heads, tgt_len, src_len]

        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn = softmax_dropout(attn_weights, self.dropout, self.training, bias=attn_bias)

        o = torch.bmm(attn, v)
        assert list(o.size()) == [bsz * self.num_heads, tgt_len, self.head_dim]
        o = o.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2).contiguous().view(
            bsz, tgt_len, embed_dim)
        o = self.out_proj(o)
        return o


# unicore/modules/transformer_decoder_layer.py
class TransformerDecoderLayer(nn.Module):
    def __init__(self, embed_dim: int = 768, ffn_embed_dim: int = 3072, attention_heads: int = 8,
                 dropout: float = 0.1, attention_dropout: float = 0.1, activation_dropout: float = 0.0,
                 activation_fn: str = "gelu", post_ln=False) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.attention_heads = attention_heads
        self.attention_dropout = attention_dropout
        self.dropout = dropout
        self.activation_dropout = activation_dropout
        self.activation_fn = get_activation_fn(activation_fn)
        self.self_attn = SelfMultiheadAttention(self.embed_dim, attention_heads, dropout=attention_dropout)
        self.self_attn_layer_norm = LayerNorm(self.embed_dim)
        self.encoder_attn = CrossMultiheadAttention(self.embed_dim, attention_heads, dropout=attention_dropout)
        self.encoder_attn_layer_norm = LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, self.embed_dim)
        self.final_layer_norm = LayerNorm(self.embed_dim)
        self.post_ln = post_ln

    def forward(self, x: torch.Tensor, encoder_out: torch.Tensor = None, attn_bias: Optional[torch.Tensor] = None,
                padding_mask: Optional[torch.Tensor] = None, encoder_attn_bias: Optional[torch.Tensor] = None,
                encoder_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        residual = x
        if not self.post_ln:
            x = self.self_attn_layer_norm(x)
        x = self.self_attn(query=x, key_padding_mask=padding_mask, attn_bias=attn_bias)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        if self.post_ln:
            x = self.self_attn_layer_norm(x)

        if encoder_out is not None:
            residual = x
            if not self.post_ln:
                x = self.encoder_attn_layer_norm(x)
            x = self.encoder_attn(query=x, key=encoder_out, value=encoder_out,
                                  key_padding_mask=encoder_padding_mask, attn_bias=encoder_attn_bias)
            x = F.dropout(x, p=self.dropout, training=self.training)
            x = residual + x
            if self.post_ln:
                x = self.encoder_attn_layer_norm(x)

        residual = x
        if not self.post_ln:
            x = self.final_layer_norm(x)
        x = self.fc1(x)
        x = self.activation_fn(x)
        x = F.dropout(x, p=self.activation_dropout, training=self.training)
        x = self.fc2(x)
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = residual + x
        if self.post_ln:
            x = self.final_layer_norm(x)
        return x


# unicore/modules/transformer_decoder.py
def fill_with_neg_inf(t):
    return t.fill_(float("-inf"))


def bulid_future_mask(seq_len):
    return torch.triu(fill_with_neg_inf(torch.zeros([seq_len, seq_len])), 1)


class TransformerDecoder(nn.Module):
    def __init__(self, decoder_layers: int = 6, embed_dim: int = 768, ffn_embed_dim: int = 3072,
                 attention_heads: int = 8, emb_dropout: float = 0.1, dropout: float = 0.1,
                 attention_dropout: float = 0.1, activation_dropout: float = 0.0, max_seq_len: int = 256,
                 activation_fn: str = "gelu", rel_pos: bool = True, rel_pos_bins: int = 32,
                 max_rel_pos: int = 128, post_ln: bool = False, auto_regressive: bool = True) -> None:
        super().__init__()
        self.emb_dropout = emb_dropout
        self.max_seq_len = max_seq_len
        self.embed_dim = embed_dim
        self.attention_heads = attention_heads
        self.emb_layer_norm = LayerNorm(self.embed_dim)
        self.auto_regressive = auto_regressive
        if self.auto_regressive:
            self._future_mask = bulid_future_mask(self.max_seq_len)
        else:
            self._future_mask = None
        if not post_ln:
            self.final_layer_norm = LayerNorm(self.embed_dim)
        else:
            self.final_layer_norm = None

        self.layers = nn.ModuleList(
            [
                TransformerDecoderLayer(
                    embed_dim=self.embed_dim,
                    ffn_embed_dim=ffn_embed_dim,
                    attention_heads=attention_heads,
                    dropout=dropout,
                    attention_dropout=attention_dropout,
                    activation_dropout=activation_dropout,
                    activation_fn=activation_fn,
                    post_ln=post_ln,
                )
                for _ in range(decoder_layers)
            ]
        )

        self.rel_pos = rel_pos  # the relative-position bucket bias (rel_pos=True) is trimmed from this port

    def get_future_mask(self, x, attn_mask):
        if not self.auto_regressive:
            return attn_mask
        if self._future_mask.device != x.device:
            self._future_mask = self._future_mask.to(x.device)
        if self._future_mask.dtype != x.dtype:
            self._future_mask = self._future_mask.type_as(x)
        if attn_mask is None:
            ret = self._future_mask[:x.size(1), :x.size(1)]
            ret = ret.contiguous().unsqueeze(0).repeat(x.size(0) * self.attention_heads, 1, 1)
            if FIXED:
                return ret
        else:
            assert list(attn_mask.size()) == [x.size(0) * self.attention_heads, x.size(1), x.size(1)]
            return attn_mask + self._future_mask[:x.size(1), :x.size(1)]

    def forward(self, emb, encoder_out: Optional[torch.Tensor] = None, padding_mask: Optional[torch.Tensor] = None,
                encoder_padding_mask: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                encoder_attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        seq_len = emb.size(1)
        x = self.emb_layer_norm(emb)
        x = F.dropout(x, p=self.emb_dropout, training=self.training)

        # account for padding while computing the representation
        if padding_mask is not None:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))

        rel_pos_bias = None  # self.get_rel_pos_bias(x).repeat(x.size(0), 1, 1) if self.rel_pos else None

        if attn_mask is None:
            attn_mask = rel_pos_bias
        elif rel_pos_bias is not None:
            attn_mask += rel_pos_bias

        if self.auto_regressive:
            attn_mask = self.get_future_mask(x, attn_mask)

        if attn_mask is not None and padding_mask is not None:
            # merge key_padding_mask and attn_mask
            attn_mask = attn_mask.view(x.size(0), -1, seq_len, seq_len)
            attn_mask.masked_fill_(padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_mask = attn_mask.view(-1, seq_len, seq_len)
            padding_mask = None

        for layer in self.layers:
            x = layer(x, encoder_out=encoder_out, padding_mask=padding_mask, attn_bias=attn_mask,
                      encoder_padding_mask=encoder_padding_mask, encoder_attn_bias=encoder_attn_mask)

        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)

        return x


# A SMILES decoder on top: token embedding, the decoder, an LM head.
SMILES_VOCAB = ["[PAD]", "[CLS]", "[SEP]", "C", "c", "O", "N", "(", ")", "=", "1", "2"]
PAD = SMILES_VOCAB.index("[PAD]")


def tokenize(smiles):
    return [SMILES_VOCAB.index("[CLS]")] + [SMILES_VOCAB.index(ch) for ch in smiles] + [SMILES_VOCAB.index("[SEP]")]


class SmilesDecoder(nn.Module):
    def __init__(self, vocab_size, embed_dim=32, heads=4, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, embed_dim, padding_idx=PAD)
        self.decoder = TransformerDecoder(decoder_layers=layers, embed_dim=embed_dim, ffn_embed_dim=64,
                                          attention_heads=heads, max_seq_len=64, rel_pos=False,
                                          auto_regressive=True)
        self.lm_head = nn.Linear(embed_dim, vocab_size)

    def forward(self, tokens, encoder_out, encoder_padding_mask):
        padding_mask = tokens.eq(PAD)
        if not padding_mask.any():
            padding_mask = None
        x = self.embed_tokens(tokens)
        x = self.decoder(x, encoder_out=encoder_out, padding_mask=padding_mask,
                         encoder_padding_mask=encoder_padding_mask)
        return self.lm_head(x)


def main():
    torch.manual_seed(0)
    model = SmilesDecoder(len(SMILES_VOCAB)).eval()

    smiles = ["CC(=O)Oc1ccccc1", "CCO"]
    seqs = [tokenize(s) for s in smiles]
    max_len = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), max_len), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)

    # the molecule encoder's output (atoms), right-padded as well
    encoder_out = torch.randn(2, 6, 32)
    encoder_padding_mask = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])

    with torch.no_grad():
        logits = model(tokens[:, :-1], encoder_out, encoder_padding_mask)
    target = tokens[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=PAD)
    print("teacher-forced loss:", round(loss.item(), 6))
    print("next-token argmax, molecule 0:", logits[0].argmax(-1).tolist())
    print("next-token argmax, molecule 1:", logits[1, : len(seqs[1]) - 1].argmax(-1).tolist())


if __name__ == "__main__":
    main()
