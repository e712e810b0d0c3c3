# Lotfollahi-lab/Perturbgen#12 ("create embedding mask for pad while leaving CLS token unmasked"),
# fixed by commit 427fdcd ("unmask CLS and mask padding"), T_perturb/Modules/T_model.py.
# TTransformer: a Geneformer (BERT) encoder over the source cell's gene-rank tokens, and a decoder over the
# target cell's gene tokens (right-padded with 0, a CLS token prepended).  In training, generate_mask draws the
# MLM-masked tokens and returns them as tgt_mask; the decoder's self-attention (CrossAttention with context=None)
# masked_fill's those key columns.  Before the fix the pad columns were never put in tgt_mask (their masking
# probability is 0), so every query attended the padded gene slots.  The fix sets tgt_mask at the pads too
# (tgt_mask.masked_fill(~tgt_pad, True)) while keeping CLS out of the MLM draw.
# einops rearrange/repeat written out with torch; 'cuda' replaced by the CPU; Geneformer built from a tiny BertConfig.
import math
import sys

import torch
from torch import nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop(x)
        x = self.fc2(x)
        x = self.drop(x)
        return x


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        if context_dim is None:
            context_dim = query_dim
        self.scale = dim_head**-0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None):
        h = self.heads
        q = self.to_q(x)
        if context is None:
            context = x
        k = self.to_k(context)
        v = self.to_v(context)
        # rearrange(t, 'b n (h d) -> (b h) n d', h=h)
        q, k, v = map(
            lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3).reshape(t.shape[0] * h, t.shape[1], -1),
            (q, k, v),
        )
        sim = torch.einsum('b i d, b j d -> b i j', q, k) * self.scale
        if mask is not None:
            device = sim.device
            mask = mask.reshape(mask.shape[0], -1)  # rearrange(mask, 'b ... -> b (...)')
            max_neg_value = -torch.finfo(sim.dtype).max
            mask = mask[:, None, None, :].expand(-1, h, 1, -1).reshape(-1, 1, mask.shape[-1])  # repeat 'b j -> (b h) () j'
            sim.masked_fill_(mask.to(device), max_neg_value)
        attn = sim.softmax(dim=-1)
        out = torch.einsum('b i j, b j d -> b i d', attn, v)
        out = out.reshape(-1, h, out.shape[1], out.shape[2]).permute(0, 2, 1, 3).reshape(-1, out.shape[1], h * out.shape[2])
        return self.to_out(out)


class DecoderLayer(nn.Module):
    def __init__(self, dim, n_heads, d_ff, dropout=0.0):
        super().__init__()
        self.self_attn = CrossAttention(dim, heads=n_heads, dim_head=dim // n_heads)
        self.cross_attn = CrossAttention(dim, heads=n_heads, dim_head=dim // n_heads)
        self.feed_forward = FeedForward(dim, d_ff)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, src_mask=None, tgt_mask=None, enc_output=None):
        attn_output = self.self_attn(x, mask=tgt_mask)
        x = self.norm1(x + self.dropout(attn_output))
        attn_output = self.cross_attn(x, context=enc_output, mask=src_mask)
        x = self.norm2(x + self.dropout(attn_output))
        ff_output = self.feed_forward(x)
        x = self.norm3(x + self.dropout(ff_output))
        return x


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_seq_length):
        super().__init__()
        pe = torch.zeros(max_seq_length, d_model)
        position = torch.arange(0, max_seq_length, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))

    def forward(self, x):
        return self.pe[:, : x.size(1)]


class Geneformerwrapper(nn.Module):
    def __init__(self, d_model, src_vocab_size):
        super().__init__()
        cfg = BertConfig(vocab_size=src_vocab_size, hidden_size=d_model, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=2 * d_model, max_position_embeddings=64, pad_token_id=0,
                         hidden_act="relu", attn_implementation="eager")
        self.model = BertModel(cfg)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class TTransformer(nn.Module):
    def __init__(self, src_vocab_size, tgt_vocab_size, d_model=32, num_heads=4, num_layers=2, d_ff=64,
                 max_seq_length=64, dropout=0.0, mlm_probability=0.5):
        super().__init__()
        self.num_features = self.embed_dim = d_model
        self.mlm_probability = mlm_probability
        self.cls_token = torch.tensor([tgt_vocab_size], dtype=torch.long)
        self.decoder_embedding = nn.Embedding(tgt_vocab_size + 1, d_model, padding_idx=0)
        self.positional_encoding = PositionalEncoding(d_model, max_seq_length)
        self.encoder_layers = Geneformerwrapper(d_model, src_vocab_size)
        self.decoder_layers = nn.ModuleList([DecoderLayer(d_model, num_heads, d_ff, dropout) for _ in range(num_layers)])
        self.fc = nn.Linear(d_model, tgt_vocab_size)
        self.dropout = nn.Dropout(dropout)

    def generate_pad(self, tgt):
        tgt_pad = (tgt != 0).clone().detach().bool().cpu()
        return tgt_pad

    def generate_mask(self, tgt, tgt_pad):
        labels = tgt.clone()
        probability_matrix = torch.full(tgt_pad.shape, self.mlm_probability)
        cls_tgt_pad = tgt_pad.clone()
        cls_tgt_pad[:, 0] = False
        probability_matrix = probability_matrix.masked_fill(~cls_tgt_pad, 0)
        tgt_mask = torch.bernoulli(probability_matrix).bool()
        labels[~tgt_mask] = -100
        labels = labels[:, 1:]
        if FIXED:
            tgt_mask = tgt_mask.masked_fill(~tgt_pad, True)
        return tgt_mask, labels

    def prepare_tokens(self, x):
        x = x + self.positional_encoding(x)
        return x

    def forward(self, src_input_id, src_attention_mask, tgt_input_id):
        tgt_input_id = torch.cat((self.cls_token.expand(tgt_input_id.shape[0], -1), tgt_input_id), dim=1)
        src_attention_mask = src_attention_mask.bool()
        tgt_pad = self.generate_pad(tgt_input_id)
        tgt_mask, labels = self.generate_mask(tgt_input_id, tgt_pad)
        src_embedded = self.encoder_layers(src_input_id, src_attention_mask)
        tgt_embedded = self.prepare_tokens(self.decoder_embedding(tgt_input_id))
        enc_output = src_embedded
        dec_output = tgt_embedded
        for dec_layer in self.decoder_layers:
            dec_output = dec_layer(dec_output, src_attention_mask, tgt_mask, enc_output)
        output = self.fc(dec_output)
        return output, labels


if __name__ == '__main__':
    torch.manual_seed(0)
    src_vocab_size, tgt_vocab_size = 50, 40
    model = TTransformer(src_vocab_size, tgt_vocab_size)
    model.train()
    # right-padded gene-rank token batches (0 = pad), as the Geneformer tokenizer + collator give them
    src_input_id = torch.tensor([[5, 9, 12, 7, 3, 0, 0, 0], [4, 8, 15, 16, 23, 42, 11, 6]])
    src_attention_mask = (src_input_id != 0).long()
    tgt_input_id = torch.tensor([[3, 17, 22, 9, 0, 0, 0], [6, 2, 30, 14, 25, 8, 11]])
    torch.manual_seed(1)
    output, labels = model(src_input_id, src_attention_mask, tgt_input_id)
    loss = nn.functional.cross_entropy(output[:, 1:].reshape(-1, tgt_vocab_size), labels.reshape(-1), ignore_index=-100)
    print("fixed" if FIXED else "buggy", "mlm loss", round(loss.item(), 6))
    print("cls output, cell 0:", [round(v, 4) for v in output[0, 0, :5].tolist()])
